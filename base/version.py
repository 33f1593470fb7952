"""The one place hipc's version is written (pyproject reads it from here)."""

HIPC_VERSION = "0.1.0"
# bump when manifest.json / plan.json change incompatibly; loaders refuse other versions
ARTIFACT_FORMAT_VERSION = 2  # 2: plan.json is the versioned launch plan (base/launch_plan.py)
# the cpu program's C entry points (hipc_forward's signature); the library reports it and the
# cpu backend refuses a library built against another. 2: a step is rows of many sequences
# (per-row positions and sequences, block tables over a paged KV pool, chosen logits rows).
# 3: a recurrent state is [slots, ...]: row t reads and writes slot seq[t] (many sequences of a
# recurrent model per step)
ABI_VERSION = 3
