"""dynsteer: dynamic activation steering and capture for an unmodified vLLM.

The vLLM plugin (``dynsteer.engine``) is loaded by vLLM itself in every process; this package's top level is the
user API and imports no vLLM internals.
"""

from dynsteer._deprecated import renamed
from dynsteer._version import __version__
from dynsteer.api import Steerer, attach, steer_params
from dynsteer.capture.reader import CaptureReader
from dynsteer.capture.result import Capture
from dynsteer.capture.spec import CaptureSpec
from dynsteer.config import DynsteerConfig
from dynsteer.request.payload import decode_payload, encode_payload
from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec
from dynsteer.spec import (SITES, TIERS, Ablation, AddVector, ModelShape, ProjectionClamp, SteeringSpec,
                           SteeringValidationError)
from dynsteer.trace import DynamicTrace
from dynsteer.vectors import load_vector, save_vector

__all__ = ["Ablation", "Action", "AddVector", "Capture", "CaptureReader", "CaptureSpec", "DynamicSteeringPolicy",
           "DynamicTrace", "DynsteerConfig", "ModelShape", "ProbeGate", "ProjectionClamp", "Rule", "SITES", "Steerer",
           "SteeringSpec", "SteeringValidationError", "SyncControllerSpec", "TIERS", "attach", "decode_payload",
           "encode_payload", "load_vector", "save_vector", "steer_params"]

# Old name kept for one release: the in-graph gate was ``Monitor``, a name the monitor-service client also had.
__getattr__ = renamed(__name__, {"Monitor": ("ProbeGate", ProbeGate)})
