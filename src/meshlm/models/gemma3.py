"""gemma3 (text): gemma2's sandwich blocks plus per-head q/k (1 + w) RMSNorms (model.qk_norm), with
5 local : 1 global layers whose RoPE differs (local: rope_local_theta, unscaled; global: rope_theta
with linear rope_scaling). The pattern, the ropes and the grouped scan are the decoder's."""
from __future__ import annotations

import dataclasses

from meshlm.models import gemma2

FAMILY = dataclasses.replace(gemma2.FAMILY, name="gemma3")
