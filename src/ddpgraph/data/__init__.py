"""What feeds a :class:`~ddpgraph.TrainStep` at graph speed.

* :func:`pad_batch` (:mod:`.pad`): shape buckets, so a few graphs serve every length;
* :func:`prefetch` (:mod:`.prefetch`): the next batch pinned and copied on a side stream;
* :class:`DeviceData` (:mod:`.device_data`): the data set on the device, DistributedSampler's
  order, batches gathered inside the graph.
"""

from __future__ import annotations

from .device_data import DeviceData, fits_on_device
from .pad import IGNORE_INDEX, pad_batch
from .prefetch import Prefetcher, prefetch, upload_into

__all__ = [
    "IGNORE_INDEX",
    "DeviceData",
    "Prefetcher",
    "fits_on_device",
    "pad_batch",
    "prefetch",
    "upload_into",
]
