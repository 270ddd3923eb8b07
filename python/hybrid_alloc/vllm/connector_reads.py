"""What a KV connector's scheduler side reads through the manager, found in its source
before vLLM's scheduler binds it (every supported vLLM release): how a connector loaded
from a module path (``kv_connector_module_path``) is vetted.

A connector's scheduler side meets the manager in two ways only:

- the arguments vLLM's scheduler hands it (``KVCacheBlocks`` in ``update_state_after_alloc``,
  block ids in ``request_finished(_all_groups)``, ``SchedulerOutput``, ``Request``), which the
  manager serves in vLLM's shapes, for every connector;
- what ``bind_kv_cache_manager(manager)`` gives it: vLLM's base class stores the manager as
  ``self._kv_cache_manager`` and hands ``manager.block_pool`` to ``bind_gpu_block_pool``, a
  no-op unless the connector overrides it.

:func:`unserved_reads` follows the second: from the manager (any ``._kv_cache_manager``) and
from the parameters of the connector's own ``bind_kv_cache_manager`` / ``bind_gpu_block_pool``
overrides, through local names, attributes the code stores them in (``self._gpu_block_pool =
pool``: every ``._gpu_block_pool`` read is then the pool), items and iteration
(``pool.blocks[i]`` is a block, ``coordinator.single_type_managers[g]`` a single-type manager),
calls of the served methods that return blocks, and calls that hand them to other functions of
the connector's package (found by name; a parameter that receives one is followed in turn, and
what a function returns is followed at its callers). Every attribute read on these objects must
be one the manager serves (:data:`SERVED`, which a test checks against a built manager);
``getattr`` / ``hasattr`` with a constant name count as reads. A read of anything else, or a
hand-off to code that cannot be found, is a finding: the connector falls back, and the reason
names the first one (the read and where it is).

The analysis over-approximates (a branch never taken at this configuration still counts; an
attribute name stored from the manager counts wherever it is read), so it errs towards the
fallback, never towards serving a connector that reads something unserved through these paths.
What it does not see: a connector reaching the manager by other means than its binding
(``gc``, frame inspection), or through ``setattr``/``getattr`` with computed names.

Cost: once per connector class (cached), at the manager's construction: the connector's
modules and, of the rest of its package's loaded modules, only those whose source names a
followed attribute or function are parsed (LMCache's ``LMCacheConnectorV1Dynamic``: its own
module, about 0.1 s).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from dataclasses import dataclass, field
from types import ModuleType

__all__ = ["SERVED", "unserved_reads"]

#: What the manager serves, by the kind of object a connector reads it from (the attributes and
#: methods of ``HybridKVCacheManager`` and its facades that vLLM's objects have too; see
#: ``docs/compatibility.md``, "What callers read through the manager").
SERVED: dict[str, frozenset[str]] = {
    "manager": frozenset(
        {
            "allocate_slots",
            "block_pool",
            "cache_blocks",
            "coordinator",
            "create_kv_cache_blocks",
            "empty_kv_cache_blocks",
            "enable_caching",
            "enable_kv_cache_events",
            "estimate_cached_tokens",
            "evict_blocks",
            "finalize_partial_tail_offloads",
            "free",
            "get_block_ids",
            "get_block_ids_for_computed_tokens",
            "get_blocks",
            "get_computed_blocks",
            "get_computed_blocks_for_connector",
            "kv_cache_config",
            "kv_cache_event_metadata",
            "log_stats",
            "make_prefix_cache_stats",
            "mamba_shared_prefix_checkpoint",
            "max_model_len",
            "metrics_collector",
            "new_step_starts",
            "num_kv_cache_groups",
            "pop_blocks_for_free",
            "prefix_cache_lookup_enabled",
            "prefix_cache_stats",
            "record_blocks_for_zeroing",
            "record_prefix_cache_stats",
            "remove_skipped_blocks",
            "reset_prefix_cache",
            "retained_hit_group_ids",
            "take_boundary_state_offloads",
            "take_events",
            "take_kv_cache_block_copies",
            "take_new_block_ids",
            "truncate_computed_blocks",
            "usage",
            "use_eagle",
            "watermark_blocks",
        }
    ),
    "block_pool": frozenset(
        {
            "blocks",
            "enable_caching",
            "evict_blocks",
            "free_block_queue",
            "free_blocks",
            "get_cached_block",
            "get_num_free_blocks",
            "get_usage",
            "hash_block_size",
            "null_block",
            "num_gpu_blocks",
            "reset_prefix_cache",
            "take_events",
        }
    ),
    "coordinator": frozenset(
        {
            "block_pool",
            "dcp_world_size",
            "drop_eagle_group_ids",
            "eagle_group_ids",
            "enable_caching",
            "enable_partial_hash_hits",
            "find_longest_cache_hit",
            "find_longest_cache_hit_per_group",
            "full_attention_group_id",
            "get_blocks",
            "get_num_blocks_to_allocate",
            "hash_block_size",
            "kv_cache_config",
            "num_reprefillable_tokens",
            "num_single_type_manager",
            "pcp_world_size",
            "retention_interval",
            "scheduler_block_size",
            "single_type_managers",
            "use_eagle",
        }
    ),
    "single_type_manager": frozenset(
        {
            "block_pool",
            "block_size",
            "cache_hit_alignment_tokens",
            "dcp_world_size",
            "enable_caching",
            "kv_cache_group_id",
            "kv_cache_spec",
            "mamba_cache_mode",
            "max_admission_blocks_per_request",
            "num_speculative_blocks",
            "pcp_world_size",
            "req_to_blocks",
            "retains_longer_hit",
            "scheduler_block_size",
            "use_eagle",
        }
    ),
    "free_block_queue": frozenset({"get_all_free_blocks", "iter_blocks_after", "num_free_blocks"}),
    "block": frozenset({"block_hash", "block_hash_num_tokens", "block_id", "is_null", "ref_cnt"}),
    # A sequence of blocks (``block_pool.blocks``, a method's block list): items and iteration.
    "blocks": frozenset(),
    "single_type_managers": frozenset(),
}

# What reading an attribute of a kind gives (anything else: a value that is not followed).
_ATTR_KIND: dict[tuple[str, str], str] = {
    ("manager", "block_pool"): "block_pool",
    ("manager", "coordinator"): "coordinator",
    ("coordinator", "block_pool"): "block_pool",
    ("coordinator", "single_type_managers"): "single_type_managers",
    ("single_type_manager", "block_pool"): "block_pool",
    ("block_pool", "free_block_queue"): "free_block_queue",
    ("block_pool", "blocks"): "blocks",
    ("block_pool", "null_block"): "block",
}
# What calling a served method gives.
_CALL_KIND: dict[tuple[str, str], str] = {
    ("block_pool", "get_cached_block"): "blocks",
    ("free_block_queue", "iter_blocks_after"): "blocks",
    ("free_block_queue", "get_all_free_blocks"): "blocks",
}
# An item of (and iteration over) a kind.
_ITEM_KIND = {"blocks": "block", "single_type_managers": "single_type_manager"}

# Calls that take one of these objects without reading it, or read only what they name.
_HARMLESS_CALLS = frozenset(
    {"isinstance", "id", "type", "repr", "str", "print", "bool", "len", "list", "tuple", "iter", "cast"}
)
_LOG_METHODS = frozenset(
    {"debug", "info", "warning", "error", "exception", "critical", "log", "debug_once", "info_once", "warning_once"}
)
# vLLM's base class's hooks (not in the connector's package): the base stores the manager in
# ``_kv_cache_manager`` and hands ``manager.block_pool`` to ``bind_gpu_block_pool``.
_BASE_HOOKS = {"bind_kv_cache_manager": "manager", "bind_gpu_block_pool": "block_pool"}
_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@dataclass
class _Func:
    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    is_method: bool
    #: The class it is a method of (``None``: a module-level function).
    owner: str | None = None
    #: Parameters known to hold a followed object, by name.
    roots: dict[str, str] = field(default_factory=dict)


class _Analysis:
    """One connector class's analysis over the modules of its package (see the module)."""

    def __init__(self, packages: set[str], own_modules: list[str], own_classes: list[str]) -> None:
        self.modules = {
            name: mod
            for name, mod in list(sys.modules.items())
            if isinstance(mod, ModuleType) and name.split(".")[0] in packages
        }
        self._text: dict[str, str] = {}
        self._parsed: dict[str, ast.Module | None] = {}
        self.funcs: dict[str, list[_Func]] = {}  # by simple name, over the parsed modules
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        # Attribute name -> {class whose methods stored it (None: any object) -> kind}.
        self.attr_roots: dict[str, dict[str | None, str]] = {"_kv_cache_manager": {None: "manager"}}
        # The connector's own classes: an attribute its methods store is read by its methods.
        self.own_classes = set(own_classes)
        self.returns: dict[str, str] = {}  # function name -> the kind it returns
        self.findings: dict[tuple[str, int, str], None] = {}
        for m in own_modules:
            self._parse(m)

    # ---- sources ----------------------------------------------------------------------

    def text(self, name: str) -> str:
        if name not in self._text:
            try:
                self._text[name] = inspect.getsource(self.modules[name])
            except (OSError, TypeError, KeyError):
                self._text[name] = ""
        return self._text[name]

    def _parse(self, name: str) -> None:
        if name in self._parsed:
            return
        src = self.text(name)
        try:
            tree = ast.parse(src) if src else None
        except SyntaxError:
            tree = None
        self._parsed[name] = tree
        if tree is None:
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append((name, node))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.funcs.setdefault(item.name, []).append(_Func(name, item, True, node.name))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.funcs.setdefault(node.name, []).append(_Func(name, node, False))

    def parse_naming(self, needle: str) -> None:
        """Parses every module of the package whose source contains ``needle``."""
        for name in list(self.modules):
            if name not in self._parsed and needle in self.text(name):
                self._parse(name)

    # ---- kinds ------------------------------------------------------------------------

    def _related(self, owner: str) -> set[str]:
        """The classes whose methods may run on an object whose class's method ``owner``
        stored an attribute: the connector's own classes for one of them, else ``owner``'s
        bases and subclasses among the parsed classes (by name)."""
        if owner in self.own_classes:
            return self.own_classes
        bases = {
            c: {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            for defs in self.classes.values()
            for _, node in defs
            for c in [node.name]
        }
        up, todo = {owner}, [owner]
        while todo:
            for b in bases.get(todo.pop(), ()):
                if b not in up:
                    up.add(b)
                    todo.append(b)
        down = {c for c in bases if owner in self._ancestors(c, bases)}
        return up | down

    @staticmethod
    def _ancestors(c: str, bases: dict[str, set[str]]) -> set[str]:
        seen, todo = set(), [c]
        while todo:
            for b in bases.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    def attr_root(self, attr: str, on_self: bool, cls: str | None) -> str | None:
        """The kind an attribute ``attr`` holds when read (``self.attr`` in a method of
        ``cls`` when ``on_self``), if it is one the code stored a followed object in."""
        owners = self.attr_roots.get(attr)
        if not owners:
            return None
        if None in owners:
            return owners[None]
        if not on_self or cls is None:
            return next(iter(owners.values()))
        for owner, kind in owners.items():
            if owner is not None and cls in self._related(owner):
                return kind
        return None

    def kind_of(self, expr: ast.expr, env: dict[str, str], cls: str | None = None) -> str | None:
        if isinstance(expr, ast.Name):
            return env.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.kind_of(expr.value, env, cls)
            if base is not None:
                return _ATTR_KIND.get((base, expr.attr))
            on_self = isinstance(expr.value, ast.Name) and expr.value.id == "self"
            return self.attr_root(expr.attr, on_self, cls)
        if isinstance(expr, ast.Subscript):
            base = self.kind_of(expr.value, env, cls)
            return None if base is None else _ITEM_KIND.get(base)
        if isinstance(expr, ast.Call):
            f = expr.func
            if isinstance(f, ast.Attribute):
                base = self.kind_of(f.value, env, cls)
                if base is not None:
                    return _CALL_KIND.get((base, f.attr))
                return self.returns.get(f.attr)
            if isinstance(f, ast.Name):
                return self.returns.get(f.id)
            return None
        if isinstance(expr, ast.IfExp):
            return self.kind_of(expr.body, env, cls) or self.kind_of(expr.orelse, env, cls)
        if isinstance(expr, ast.NamedExpr):
            return self.kind_of(expr.value, env, cls)
        return None

    # ---- one function -----------------------------------------------------------------

    def finding(self, module: str, node: ast.AST, what: str) -> None:
        self.findings[(module, getattr(node, "lineno", 0), what)] = None

    def visit(self, fn: _Func) -> bool:
        """Analyses one function; returns whether it added a root (another round is due)."""
        env = dict(fn.roots)
        changed = False
        body = list(ast.walk(fn.node))
        # Local names bound from followed objects (twice: a name bound from another).
        for _ in range(2):
            for node in body:
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    kind = self.kind_of(node.value, env, fn.owner)
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if kind is not None:
                        for t in targets:
                            if isinstance(t, ast.Name):
                                env[t.id] = kind
                elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                    item = _ITEM_KIND.get(self.kind_of(node.iter, env, fn.owner) or "")
                    if item is not None and isinstance(node.target, ast.Name):
                        env[node.target.id] = item
        for node in body:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                kind = self.kind_of(node.value, env, fn.owner)
                if kind is not None and node.attr not in SERVED[kind]:
                    self.finding(fn.module, node, f"reads {kind}.{node.attr}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                kind = self.kind_of(node.value, env, fn.owner)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if kind is None or not isinstance(t, ast.Attribute):
                        continue
                    on_self = isinstance(t.value, ast.Name) and t.value.id == "self"
                    owner = fn.owner if on_self else None
                    owners = self.attr_roots.setdefault(t.attr, {})
                    if owners.get(owner) != kind:
                        owners[owner] = kind
                        self.parse_naming(f".{t.attr}")
                        changed = True
            elif isinstance(node, ast.Return) and node.value is not None:
                kind = self.kind_of(node.value, env, fn.owner)
                if kind is not None and self.returns.get(fn.node.name) != kind:
                    self.returns[fn.node.name] = kind
                    self.parse_naming(f"{fn.node.name}(")
                    changed = True
            elif isinstance(node, ast.Call):
                changed |= self.visit_call(fn, node, env)
        return changed

    def visit_call(self, fn: _Func, call: ast.Call, env: dict[str, str]) -> bool:
        f = call.func
        passed = [(i, a) for i, a in enumerate(call.args)] + [(k.arg, k.value) for k in call.keywords]
        kinds = [(pos, self.kind_of(a, env, fn.owner)) for pos, a in passed]
        kinds = [(pos, k) for pos, k in kinds if k is not None]
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in ("getattr", "hasattr") and len(call.args) >= 2:
            kind = self.kind_of(call.args[0], env, fn.owner)
            attr = call.args[1]
            if kind is not None:
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    if attr.value not in SERVED[kind]:
                        self.finding(fn.module, call, f"reads {kind}.{attr.value}")
                else:
                    self.finding(fn.module, call, f"reads an attribute of {kind} by a computed name")
            return False
        if not kinds:
            return False
        if isinstance(f, ast.Attribute) and self.kind_of(f.value, env, fn.owner) is not None:
            return False  # a served method of a followed object (its read is checked above)
        if name is None or name in _HARMLESS_CALLS or (isinstance(f, ast.Attribute) and name in _LOG_METHODS):
            if name is None:
                self.finding(fn.module, call, f"hands {kinds[0][1]} to a computed callee")
            return False
        self.parse_naming(f"def {name}(")
        self.parse_naming(f"class {name}")
        targets = [(g, g.is_method) for g in self.funcs.get(name, [])]
        for _, cls in self.classes.get(name, []):
            targets += [
                (g, True)
                for g in self.funcs.get("__init__", [])
                if g.node in cls.body  # the constructor
            ]
        if not targets:
            if name in _BASE_HOOKS:
                return False  # vLLM's base class's hook (see ``_BASE_HOOKS``)
            self.finding(fn.module, call, f"hands {kinds[0][1]} to {name}(), whose code is not found")
            return False
        changed = False
        for g, is_method in targets:
            params = [a.arg for a in g.node.args.posonlyargs + g.node.args.args]
            if is_method and params:
                params = params[1:]
            names = {a.arg for a in g.node.args.kwonlyargs} | set(params)
            for pos, kind in kinds:
                if isinstance(pos, int):
                    param = params[pos] if pos < len(params) else None
                else:
                    param = pos if pos in names else None
                if param is None:
                    self.finding(g.module, g.node, f"receives {kind} in arguments that cannot be followed")
                elif kind is not None and g.roots.get(param) != kind:
                    g.roots[param] = kind
                    changed = True
        return changed

    def run(self) -> list[str]:
        for _ in range(50):  # a fixed point: roots only grow, over finitely many names
            if not any([self.visit(g) for gs in list(self.funcs.values()) for g in list(gs)]):
                break
        return [f"{what} ({m}:{line})" for m, line, what in sorted(self.findings)]


def _user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO whose code is the connector's own (not vLLM's, not the
    standard library's)."""
    return [k for k in cls.__mro__ if k.__module__.split(".")[0] not in ("vllm", "builtins", "abc", "typing")]


@functools.cache
def unserved_reads(cls: type) -> tuple[str, ...]:
    """What the scheduler side of connector class ``cls`` reads through the manager that the
    manager does not serve, as ``"reads block_pool.touch (module:line)"``-style findings
    (see the module); empty when it reads only what is served. Only ``cls``'s own code (the
    classes of its MRO outside vLLM, and the package they live in) is analysed: vLLM's classes
    in its MRO are judged by the connector rules of :mod:`.connector`."""
    own = _user_classes(cls)
    if not own:
        return ()
    own_modules = sorted({k.__module__ for k in own})
    analysis = _Analysis({m.split(".")[0] for m in own_modules}, own_modules, [k.__name__ for k in own])
    # The hooks the connector overrides: their parameters are the manager and the pool.
    for k in own:
        for hook, kind in _BASE_HOOKS.items():
            if hook in vars(k):
                for g in analysis.funcs.get(hook, []):
                    if g.module == k.__module__ and g.owner == k.__name__:
                        params = [a.arg for a in g.node.args.args][1:]
                        if params:
                            g.roots[params[0]] = kind
    analysis.parse_naming("._kv_cache_manager")
    return tuple(analysis.run())
