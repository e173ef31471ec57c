"""Bounded, strict YAML loading for every file an operator hands to egressgate (policies, policy test
cases, the gateway config).

PyYAML's SafeLoader is safe against code execution but not against shapes: a complex key (`? [a, b]`)
builds an unhashable list key, deep nesting recurses until RecursionError, and aliases ("billion
laughs") expand a few hundred bytes into an exponentially large tree that validation then walks. Any of
these crashed `policy check` with a traceback and killed the gateway's policy watcher. Here every such
shape is a `YamlError` that says where (line, column) and what limit was hit, before anything is built:

* nesting depth is counted while composing (the composer is recursive, so the check must come first);
* the *expanded* size (every alias counted as the full subtree it stands for) is computed over the
  composed node graph with memoization, so a billion-laughs document is refused in linear time;
* keys must be plain scalars that construct to strings (a policy has no other kind of key) and appear
  once (YAML's last-one-wins would silently drop a rule).
"""

from __future__ import annotations

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_DEPTH = 64  # nesting of mappings/sequences; real policies use < 10
MAX_NODES = 200_000  # expanded nodes (aliases counted in full)


class YamlError(ValueError):
    """A document egressgate refuses to load; `where` is 'line L, column C' or '<document>'."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "<document>"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with a nesting bound in the (recursive) composer."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlError(_where(mark), f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _BoundedLoader, node: MappingNode, deep: bool = False) -> dict:
    seen: set[str] = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, ScalarNode):
            raise YamlError(_where(key_node.start_mark), "a key must be a plain string, not a list or mapping")
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str):
            raise YamlError(_where(key_node.start_mark),
                            f"key {key!r} is not a string ({type(key).__name__}); quote it")
        if key in seen:
            raise YamlError(_where(key_node.start_mark), f"duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _expanded_size(root: Node) -> int:
    """Nodes of the tree the document stands for, aliases expanded; iterative and memoized per node
    object (an alias is the same node object as its anchor), so it costs O(distinct nodes)."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if not children_done and key in sizes:
            continue
        if not children_done and key in visiting:  # an anchor used inside itself: an infinite tree
            raise YamlError(_where(node.start_mark), "an alias refers to a value that contains it")
        if isinstance(node, ScalarNode):
            sizes[key] = 1
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, MappingNode)
                    else list(node.value) if isinstance(node, SequenceNode) else [])
        if not children_done:
            visiting.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        visiting.discard(key)
        sizes[key] = min(1 + sum(sizes[id(c)] for c in children), MAX_NODES + 1)
    return sizes[id(root)]


def load_yaml(text: str) -> object:
    """Parse one YAML document within the limits above; raises YamlError (never another exception)."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise YamlError(_where(node.start_mark),
                            f"more than {MAX_NODES} values once aliases are expanded (an alias bomb?)")
        return loader.construct_document(node)
    except YamlError:
        raise
    except yaml.MarkedYAMLError as exc:
        raise YamlError(_where(exc.problem_mark), f"invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise YamlError("<document>", f"invalid YAML: {exc}") from None
    except RecursionError:  # a construct path the depth bound did not foresee: still a clean refusal
        raise YamlError("<document>", "nested too deeply") from None
    except (TypeError, ValueError) as exc:  # e.g. a bad timestamp or base64 scalar
        raise YamlError("<document>", f"invalid value: {exc}") from None
    finally:
        loader.dispose()
