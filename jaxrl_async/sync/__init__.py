"""ParameterSynchronizer: versioned weights from the learner to the rollout side."""

from jaxrl_async.sync.channel import (
                                      DeviceTransferChannel,
                                      OrbaxStoreChannel,
                                      WeightChannel,
                                      tree_bytes,
)
from jaxrl_async.sync.store_channel import TensorStoreChannel, store_options

__all__ = ["DeviceTransferChannel", "OrbaxStoreChannel", "TensorStoreChannel", "WeightChannel",
           "store_options", "tree_bytes"]
