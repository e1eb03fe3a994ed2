"""torch.compile checks shared by the tests of compiled modules."""

from __future__ import annotations

import torch


def compiled_whole(fn):
    """fn under torch.compile with fullgraph (a graph break raises) through AOT autograd's fake tensors
    (every op's fake kernel runs), executed eagerly; returns it and the captured graphs."""
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def graph_targets(gm) -> list[str]:
    """The functions and methods a captured graph calls, by name."""
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
