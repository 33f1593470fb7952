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
}
# the weight types the CPU kernels read (GPU kernels read every WEIGHT_SUFFIX type)
CPU_WTYPES = (
    "float32", "float16", "bfloat16", "q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k",
    "iq4_nl", "iq4_xs",
)  # fmt: skip


# Weight storage types each target family has linear and embedding kernels for. A model
# with any other type is refused before rendering (check_weight_types), naming the tensor.
KERNEL_WTYPES = {"cpu": CPU_WTYPES, "hip": tuple(WEIGHT_SUFFIX)}


def check_weight_types(kernels, initializers: dict, target_family: str) -> None:
    """Refuse the first weight whose type the target family ("cpu", "nvidia", "amd") has no
    kernel for, in one line naming the tensor(s) as the model file does, its type and the
    supported types."""
    family = "cpu" if target_family == "cpu" else "hip"
    supported = KERNEL_WTYPES[family]
    for k in kernels:
        wtype = getattr(k.params, "wtype", None)
        if wtype is None or wtype in supported:
            continue
        ref = k.refs["w"][1]
        init = initializers.get(ref)
        parts = getattr(init, "parts", None) or (init,)
        names = ", ".join(getattr(r, "name", ref) for r in parts)
        raise HipcError(
            f"{names}: weight type {wtype} has no {family.upper()} kernel "
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
