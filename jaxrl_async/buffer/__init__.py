"""VersionedBuffer: admission, age bound, group assembly, drop accounting, grain dataset, state."""

from jaxrl_async.buffer.accounting import LATENCY_WINDOW
from jaxrl_async.buffer.admission import admission_budget
from jaxrl_async.buffer.errors import BufferClosed, BufferTimeout
from jaxrl_async.buffer.grain_dataset import (
                                              BufferDataset,
                                              BufferDatasetIterator,
                                              checkpoint_restore_args,
                                              checkpoint_save_args,
                                              restore_buffer_checkpoint,
                                              save_buffer_checkpoint,
)
from jaxrl_async.buffer.groups import GROUP_DROP_PRIORITY, drop_uniform_reward
from jaxrl_async.buffer.versioned_buffer import VersionedBuffer

__all__ = [
                                              "GROUP_DROP_PRIORITY",
                                              "LATENCY_WINDOW",
                                              "BufferClosed",
                                              "BufferDataset",
                                              "BufferDatasetIterator",
                                              "BufferTimeout",
                                              "VersionedBuffer",
                                              "admission_budget",
                                              "checkpoint_restore_args",
                                              "checkpoint_save_args",
                                              "drop_uniform_reward",
                                              "restore_buffer_checkpoint",
                                              "save_buffer_checkpoint",
]
