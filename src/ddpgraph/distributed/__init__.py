"""The distributed runtime under the step: process set-up, hangs made errors, object collectives.

=====================  =========================================================================
``runtime``            ``init()`` / ``shutdown()`` / ``Runtime``: torchrun's environment, each
                       rank bound to its device before any CUDA work, NCCL or gloo, checks
``store``              the one store barrier
``watchdog``           heartbeats; a watched call or replay not done in time → CollectiveTimeout
``watchdog_messages``  what the watchdog says, decided from every rank's heartbeat
``objects``            all_gather_object / gather_object / broadcast_object: the same error on
                       every rank, ``timeout=`` names missing ranks
``codec``              the safe data codec objects travel in (never pickle by default)
``torch_patch``        torch's own object collectives routed through ``objects``
``launch``             ``ddpgraph launch``: torchrun's launcher with guard rails
=====================  =========================================================================
"""
