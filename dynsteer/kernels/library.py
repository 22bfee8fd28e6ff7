"""The ``dynsteer`` operator library object for ops defined directly (not through ``torch.library.custom_op``).

Its own module so that reloading ``dynsteer.kernels.ops`` (tests do) never drops it: a ``Library`` removes its
definitions when it is garbage-collected.
"""

from __future__ import annotations

import torch

LIB = torch.library.Library("dynsteer", "FRAGMENT")
