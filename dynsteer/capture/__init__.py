"""Capture: what to record from the residual stream, how the engine collects it, and how the caller receives it.

For users:

* :class:`CaptureSpec` — sites, layers, token positions and dtype of a request's capture (sent with the request);
* :class:`Capture` — a finished request's activations, as the caller receives them;
* :class:`CaptureReader` — reads captures a ``filesystem`` consumer wrote to disk;
* consumers, where finished captures go (``DynsteerConfig.capture_consumer``): :class:`MemoryConsumer`,
  :class:`FilesystemConsumer`, :class:`ZmqConsumer` (:func:`receive_capture` decodes its messages), all following
  the :class:`CaptureConsumer` protocol.

The collector that fills records during the forward pass (``store``), the records, the position ledger and the
shared-memory spool are the engine's side and not exported.
"""

from dynsteer.capture.consumers import CaptureConsumer, FilesystemConsumer, MemoryConsumer
from dynsteer.capture.reader import CaptureReader
from dynsteer.capture.result import Capture
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.zmq_consumer import ZmqConsumer, receive_capture

__all__ = ["Capture", "CaptureConsumer", "CaptureReader", "CaptureSpec", "FilesystemConsumer", "MemoryConsumer",
           "ZmqConsumer", "receive_capture"]
