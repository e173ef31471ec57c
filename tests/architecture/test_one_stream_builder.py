"""One module of the gateway sets a body's stream: compose.py (issue 25). mitmproxy feeds every body chunk to
the one callable in `flow.request.stream` / `flow.response.stream`; the budget counter, the credential scrub,
the phantom guard, the request hash and the MCP route's filter are all parts of that callable, in the
order compose.py states. A stage that assigned `stream` itself — to wrap what was built, to swap it for a
replacement, even to turn it off — could put its part in another place or drop the counter, and the order
could no longer be read in one file. So stages plan (FlowState fields) and compose.py builds and installs.

Any assignment to an attribute named `stream` counts (`flow.response.stream = …`, `resp.stream = …` through
a local name, `self.flow.request.stream = …`, an augmented or annotated assignment, a tuple target, a
`setattr(x, "stream", …)`): the gateway has no other attribute of that name.

Plain and fast: the source is parsed, nothing is imported.
"""

from __future__ import annotations

import ast

from tests.architecture.imports import PACKAGE, modules, tree

BUILDER = f"{PACKAGE}.shared.compose"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for elt in target.elts for t in _flatten(elt)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def stream_assignments(module: ast.Module) -> list[str]:
    """Every assignment to a `.stream` attribute in `module`, as `line N: <target>`."""
    found = []
    for node in ast.walk(module):
        for target in (t for raw in _targets(node) for t in _flatten(raw)):
            if isinstance(target, ast.Attribute) and target.attr == "stream":
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "stream"
        ):
            found.append(f"line {node.lineno}: setattr(…, 'stream', …)")
    return found


def test_the_check_finds_every_way_to_set_a_stream() -> None:
    """Positive control: each spelling of setting a body's stream is found; reading one, or another
    attribute, is not."""
    source = ast.parse(
        "def f(flow, self, resp, inner):\n"
        "    flow.response.stream = wrap(flow.response.stream)\n"
        "    flow.request.stream = False\n"
        "    resp.stream = inner\n"
        "    self.flow.request.stream = False\n"
        "    flow.response.stream: object = True\n"
        "    a, flow.request.stream = 1, inner\n"
        "    setattr(flow.response, 'stream', inner)\n"
        "    x = flow.response.stream\n"
        "    if callable(resp.stream): pass\n"
        "    flow.response.streaming = True\n"
    )
    assert len(stream_assignments(source)) == 7, stream_assignments(source)


def test_only_compose_py_sets_a_body_stream() -> None:
    assert BUILDER in modules()
    offenders = {name: found for name in modules() if name != BUILDER and (found := stream_assignments(tree(name)))}
    assert not offenders, f"gateway modules setting a body's stream themselves (plan it for compose.py): {offenders}"
    assert stream_assignments(tree(BUILDER)), "compose.py no longer sets a stream: the check would be vacuous"
