"""TensorBoard scalars through the `tensorboard` package's own event-file writer and protocol buffers (neither
TensorFlow nor PyTorch is imported).

    writer = EventWriter(logdir)            # a new events.out.tfevents.* file in logdir
    writer.scalars(step, {"train/loss": 2.0, "eval/tau": 1.4})
    writer.close()

Import cost, measured in fresh processes on the 2-core development machine (median of 3): this module 0.39 s
alone, 0.19 s after `train.loop`'s own imports (protobuf and numpy already loaded; `train.loop` itself takes 3-4 s);
the hand-written TFRecord writer it replaces took 0.01 s. Every scalar is flushed at once, so a running job's
curves are on disk after each logged step.
"""

from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class EventWriter:
    """Appends `{tag: value}` scalars at a step to a new `events.out.tfevents.*` file in `logdir`."""

    def __init__(self, logdir: str):
        self.writer = EventFileWriter(logdir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One Event at `step` holding a Summary with one simple_value per tag."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self.writer.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
