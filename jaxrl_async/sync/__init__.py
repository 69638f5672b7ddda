"""ParameterSynchronizer: versioned weights from the learner to the rollout side."""

from jaxrl_async.sync.channel import (
                                      DeviceTransferChannel,
                                      OrbaxStoreChannel,
                                      WeightChannel,
                                      tree_bytes,
)

__all__ = ["DeviceTransferChannel", "OrbaxStoreChannel", "WeightChannel", "tree_bytes"]
