"""Direct calls from AOTInductor's libraries into decoderlm's ops, past the proxy executor.

A library compiled by AOTInductor (`decoderlm.cpu.decode.step_library`) calls a custom op through
its proxy executor unless Inductor's `aot_inductor.custom_ops_to_c_shims` names a C function for
it; the arguments are then passed as they are, not boxed into an IValue stack and dispatched.
Measured (2026-12-06, Zen 4, 2 threads, throwaway scripts): a chain of 150 one-row Q8_0 products
of 64 × 64, 2.4-2.6 µs a call through the proxy executor against 2.0-2.1 µs direct (1 thread),
and the compiled decode step of SmolLM2-135M's Q8_0 file, 181 op calls a token, 2% faster (the
median of 20 interleaved pairs). Each ops library defines aoti_torch_cpu_<op> with `aoti_shim.h`
and is loaded with its symbols global (`native.load_ops_library`); `c_shims(graph)` declares
those a graph calls, in PyTorch's C shim ABI, from the ops' schemas.
"""

from __future__ import annotations

import ctypes

import torch

# Schema types in the C shim ABI (aoti_shim.h's `taken`).
_C_TYPES = {
    "Tensor": "AtenTensorHandle",
    "Optional[Tensor]": "AtenTensorHandle*",
    "int": "int64_t",
    "float": "double",
    "bool": "int32_t",
}


def declaration(op: torch._ops.OpOverload) -> str | None:
    """The C declaration of op's direct-call function, e.g. "AOTITorchError
    aoti_torch_cpu_gemv(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0)";
    None where its schema is not one that `aoti_shim.h` takes (arguments of `_C_TYPES`, one
    tensor returned)."""
    schema = op._schema
    types = [str(a.type) for a in schema.arguments]
    if any(t not in _C_TYPES for t in types) or [str(r.type) for r in schema.returns] != ["Tensor"]:
        return None
    params = [f"{_C_TYPES[t]} {a.name}" for t, a in zip(types, schema.arguments, strict=True)]
    name = schema.name.split("::")[1]
    return f"AOTITorchError aoti_torch_cpu_{name}({', '.join([*params, 'AtenTensorHandle* ret0'])})"


def c_shims(graph: torch.fx.Graph) -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for the decoderlm ops that `graph` calls
    whose libraries are loaded with their direct-call functions."""
    loaded = ctypes.CDLL(None)  # the process's global symbols
    shims = {}
    for node in graph.nodes:
        op = node.target
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "decoderlm":
            declared = declaration(op)
            if declared is not None and hasattr(loaded, f"aoti_torch_cpu_{op._opname}"):
                shims[op] = [declared]
    return shims
