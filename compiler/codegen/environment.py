"""The one Jinja environment every kernel template renders through.

StrictUndefined turns a missing value into an error instead of empty C++; template
errors are re-raised naming the template and line. Filters live here, in one place.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from hipc.base.errors import HipcError

# Weight storage type -> the suffix of its helpers in the templates' headers
# (hipc::matmul_q4_1 on the CPU, hipc_dot2_bf16 on GPUs).
WEIGHT_SUFFIX = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "q4_0": "q4_0",
    "q4_1": "q4_1",
    "q8_0": "q8_0",
    "q6_k": "q6_k",
    "q5_0": "q5_0",
    "q5_1": "q5_1",
    "q4_k": "q4_k",
    "q5_k": "q5_k",
    "iq4_nl": "iq4_nl",
    "iq4_xs": "iq4_xs",
    "q3_k": "q3_k",
    "q2_k": "q2_k",
}
# the weight types the CPU kernels read
CPU_WTYPES = (
    "float32", "float16", "bfloat16", "q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k",
    "iq4_nl", "iq4_xs", "q3_k", "q2_k",
)  # fmt: skip
# the weight types the GPU kernels read: the same
HIP_WTYPES = CPU_WTYPES


# Weight storage types each target family has linear and embedding kernels for. A model
# with any other type is refused before rendering (check_weight_types), naming the tensor.
KERNEL_WTYPES = {"cpu": CPU_WTYPES, "hip": HIP_WTYPES}


def check_weight_types(kernels, initializers: dict, target_family: str) -> None:
    """Refuse the first weight whose type the target family ("cpu", "nvidia", "amd") has no
    kernel for, in one line naming the tensor(s) as the model file does, its type and the
    supported types."""
    from hipc.compiler.ir import QUANT_DTYPES, PackedWeight, initializer_type

    family = "cpu" if target_family == "cpu" else "hip"
    supported = KERNEL_WTYPES[family]
    for k in kernels:
        for arg, (what, ref) in k.refs.items():
            init = initializers.get(ref) if what == "weight" else None
            if init is None:
                continue
            # a kernel's matrix ("w") in any type, its other weights (a MoE's experts,
            # norms, tables) where they are GGUF blocks
            stored = initializer_type(init).dtype
            wtype = getattr(k.params, "wtype", stored) if arg == "w" else stored
            if wtype in supported or (arg != "w" and wtype not in QUANT_DTYPES):
                continue
            if isinstance(init, PackedWeight):  # q/k/v or gate/up joined: the file's names
                name = ", ".join(r.name for r in init.parts)
            else:
                name = getattr(init, "name", ref)
            raise HipcError(
                f"{name}: weight type {wtype} has no {family.upper()} kernel "
                f"(supported: {', '.join(supported)})"
            )


def c_float(x: float) -> str:
    """A float literal C++ parses back to the same float32."""
    return f"{float(x)!r}f"  # repr always has a '.' or an exponent


@functools.lru_cache(maxsize=1)
def environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.files("hipc.templates"))),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["c_float"] = c_float
    return env


def render(template: str, **context: Any) -> str:
    import jinja2

    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'name', None) or template}:{getattr(e, 'lineno', '?')}"
        raise HipcError(f"template {where}: {e}") from None


def template_text(name: str) -> str:
    return resources.files("hipc.templates").joinpath(name).read_text(encoding="utf-8")
