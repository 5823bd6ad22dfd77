"""The main job behind ``ddpgraph train``: built-in models, a learnable synthetic data set, the loop."""
