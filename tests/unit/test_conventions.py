"""Every wrapper behaves like the function it replaces however it is called (bound, through
the class, ``super()``, a subclass, construction, subscription, a module), and the patched
classes carry upstream's interface, on the real classes."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import connector

from vllm_hsfix import checks
from vllm_hsfix.patches import PATCHES
from vllm_hsfix.patches._wrap import FunctionSwap, HsfixWrapper, Replacement
from vllm_hsfix.patches.cpu_zero_blocks import checks as zero_checks
from vllm_hsfix.state import STATE

pytestmark = pytest.mark.needs_vllm
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"


def fp8_connector() -> type:
    mod = pytest.importorskip(
        "hs_connectors.fp8_hidden_states_connector",
        reason="hs-connectors is not installed here (its layer puts it on PYTHONPATH)",
    )
    return mod.FP8HiddenStatesConnector  # type: ignore[no-any-return]


def kind_of(obj: object) -> str:
    kinds = (("classmethod", classmethod), ("staticmethod", staticmethod))
    return next((k for k, t in kinds if isinstance(obj, t)), "function")


def conventions(owner: object, name: str, kind: str) -> dict[str, Callable[[], Any]]:
    """Label -> a call of ``owner.name`` by one convention (``a`` is the argument)."""
    a = "arg"
    if isinstance(owner, ModuleType):
        return {
            "through the module": lambda: getattr(owner, name)(a),
            "a name bound from the module": lambda: (lambda fn: fn(a))(getattr(owner, name)),
        }
    cls: Any = owner
    obj, stub = cls.__new__(cls), SimpleNamespace()

    def via_super(self: Any, *args: Any, **kw: Any) -> Any:
        return getattr(super(Overrides, self), name)(*args, **kw)

    def cls_super(kls: Any, *args: Any, **kw: Any) -> Any:
        return getattr(super(Overrides, kls), name)(*args, **kw)

    body = {"function": via_super, "classmethod": classmethod(cls_super)}.get(kind)
    Overrides = type("Overrides", (cls,), {name: body} if body else {})
    Inherits = type("Inherits", (cls,), {})
    sub, inh = Overrides.__new__(Overrides), Inherits.__new__(Inherits)
    calls: dict[str, Callable[[], Any]] = {
        "bound": lambda: getattr(obj, name)(a, k=1),
        "inherited, bound": lambda: getattr(inh, name)(a),
    }
    if kind == "function":
        calls["class, explicit instance"] = lambda: getattr(cls, name)(obj, a)
        calls["class, explicit non-instance"] = lambda: getattr(cls, name)(stub, a)
        calls["super() from an override"] = lambda: getattr(sub, name)(a)
        calls["inherited, class, explicit instance"] = lambda: getattr(Inherits, name)(inh, a)
    else:
        calls["through the class"] = lambda: getattr(cls, name)(a)
        calls["through a subclass"] = lambda: getattr(Inherits, name)(a)
    if kind == "classmethod":
        calls["super() from an overriding classmethod"] = lambda: getattr(Overrides, name)(a)
    if name == "__init__":
        calls["construction"] = lambda: cls(a)
        calls["construction of a subclass"] = lambda: Inherits(a)
    if name == "__getitem__":
        calls["subscription"] = lambda: obj[a]
    return calls


def token(x: Any) -> Any:
    """Arguments compared by what they are: a class by name, an object by its type."""
    if isinstance(x, type):
        return f"class {x.__name__}"
    if isinstance(x, (str, int)):
        return x
    return f"a {type(x).__name__}"


def spy_runs(
    calls_by: dict[str, Callable[[], Any]], kind: str, install: Callable[[Any], None]
) -> dict[str, Any]:
    calls: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(([token(x) for x in args], sorted(kwargs)))

    install({"classmethod": classmethod(spy), "staticmethod": staticmethod(spy)}.get(kind, spy))
    got = {}
    for label, call in calls_by.items():
        calls.clear()
        call()
        got[label] = list(calls)
    return got


def check_binding(rep: Replacement | FunctionSwap) -> list[str]:
    owner, name = rep.owner, rep.name
    if isinstance(rep, FunctionSwap):  # a plain function for a plain function
        same = kind_of(rep.replacement) == kind_of(rep.original) and inspect.signature(
            rep.replacement, follow_wrapped=False
        ) == inspect.signature(rep.original)
        return [] if same else [f"{owner.__name__}.{name}: not bound like the original"]
    kind = kind_of(rep.wrapper.__wrapped__)
    seen: list[Any] = []

    def recorder(fn: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append(token(instance) if instance is not None else None)
        return fn(*args, **kwargs)

    # The subclasses are made first, with the real attribute in place (making one calls
    # __init_subclass__, one of the targets).
    calls_by = conventions(owner, name, kind)
    try:
        plain = spy_runs(calls_by, kind, lambda spy: setattr(owner, name, spy))
        wrapped = spy_runs(
            calls_by, kind, lambda spy: setattr(owner, name, HsfixWrapper(spy, recorder, "probe"))
        )
    finally:
        setattr(owner, name, rep.wrapper)
    where = f"{getattr(owner, '__name__', owner)}.{name} ({kind})"
    problems = [
        f"{where}, {label}: the original gets {plain[label]}, through the wrapper {wrapped[label]}"
        for label in plain
        if plain[label] != wrapped[label]
    ]
    for label, got in plain.items():  # what the wrapper must have seen as `instance`
        want = None if kind == "staticmethod" or isinstance(owner, ModuleType) else got[0][0][0]
        seen_here = seen.pop(0) if seen else "nothing"
        if seen_here != want:
            problems.append(f"{where}, {label}: the wrapper saw instance {seen_here}, not {want}")
    return problems


def test_every_replacement_binds_like_the_original(patched: Any) -> None:
    for p in PATCHES:  # a row's module that this release lacks: that row is not applied
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(p.module)
    reps = [r for rec in STATE.records.values() for r in rec.replacements]
    assert reps, "no patch applied on this release"
    problems = [p for rep in reps for p in check_binding(rep)]
    assert problems == []
    # what was checked: every applied patch's every attribute
    applied = {pid for pid, rec in STATE.records.items() if rec.status == "applied"}
    assert applied <= {pid for pid, rec in STATE.records.items() if rec.replacements}
    # and put every wrapper back (the check swaps spies in and out)
    assert [rep.name for rep in reps if not rep.in_effect()] == []


@pytest.mark.applies("hidden-group-block-size")
def test_upstreams_helpers_on_the_patched_class(patched: Any) -> None:
    """0.25.0's helpers (names, kinds, signatures, answers) run on the patched class."""
    cls = connector().ExampleHiddenStatesConnector
    config, want = checks.hybrid_layout()
    find = inspect.getattr_static(cls, "_find_cache_kv_group_id")
    size = inspect.getattr_static(cls, "_get_cache_block_size")
    assert isinstance(find, classmethod) and isinstance(size, staticmethod)
    assert list(inspect.signature(cls._find_cache_kv_group_id).parameters) == ["kv_cache_config"]
    assert list(inspect.signature(cls._get_cache_block_size).parameters) == [
        "vllm_config", "kv_cache_config", "cache_kv_group_id",
    ]  # fmt: skip
    assert cls._find_cache_kv_group_id(config) == want["group"]
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=528))
    assert cls._get_cache_block_size(vllm_config, config, cache_kv_group_id=2) == 22
    assert cls._get_cache_block_size(vllm_config, None, 0) == 528
    two = type(config)(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=config.kv_cache_groups[:2]
    )
    with pytest.raises(ValueError, match="Could not uniquely identify the extract-hidden-states"):
        cls._find_cache_kv_group_id(two)


@pytest.mark.applies("hidden-group-block-size")
@pytest.mark.parametrize(
    "how", ["class", "inherits (FP8HiddenStatesConnector)", "overrides __init__"]
)
def test_connector_init_resolves_however_built(patched: Any, how: str) -> None:
    base = connector().ExampleHiddenStatesConnector
    if how == "class":
        cls = base
    elif how.startswith("inherits"):
        cls = fp8_connector()
    else:

        class Sub(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)

        cls = Sub
    config, want = checks.hybrid_layout()
    conn = checks.construct_connector(cls, config, want["global_block_size"])
    assert (conn._cache_kv_group_id, conn._hs_group_idx, conn._block_size) == (2, 2, 22)


@pytest.mark.applies("hidden-group-block-size")
def test_a_subclass_overriding_a_helper_is_honoured(patched: Any) -> None:
    """As upstream's __init__ calls ``self._find_cache_kv_group_id``."""

    class PicksGroupZero(connector().ExampleHiddenStatesConnector):  # type: ignore[misc]
        @classmethod
        def _find_cache_kv_group_id(cls, kv_cache_config: Any) -> int:
            return 0

    config, _ = checks.hybrid_layout()
    conn = checks.construct_connector(PicksGroupZero, config, 528)
    assert (conn._cache_kv_group_id, conn._block_size) == (0, 528)


def bare(cls: type) -> Any:
    """As vLLM's own abort tests build one: no ``__init__``, scheduler-side state only."""
    conn = cls.__new__(cls)
    conn.__dict__.update(
        _request_filenames={}, _pending_saves={}, _lock_fds={}, _cache_kv_group_id=1,
        _connector_metadata=None, _req_copy_events={}, _accumulated_finished_req_ids=set(),
    )  # fmt: skip
    return conn


@pytest.mark.applies("abort-before-scheduling")
@pytest.mark.parametrize("which", ["class", "FP8HiddenStatesConnector"])
def test_abort_answers_through_the_class_and_a_subclass(patched: Any, which: str) -> None:
    base = connector().ExampleHiddenStatesConnector
    cls = base if which == "class" else fp8_connector()
    conn = bare(cls)
    never = SimpleNamespace(request_id="never", kv_transfer_params=None)
    assert list(inspect.signature(base.get_finished_count).parameters) == ["self"]
    assert conn.get_finished_count() == base.get_finished_count(conn) == 1
    assert base.request_finished(conn, never, []) == (False, None)
    assert base.get_finished(conn, finished_req_ids={"never"}) == (None, None)
    conn._cache_kv_group_id = 2
    assert base.request_finished_all_groups(conn, never, ([], [])) == (False, None)

    class Overrides(cls):  # type: ignore[misc, valid-type]
        def request_finished(self, request: Any, block_ids: Any) -> Any:
            return super().request_finished(request, block_ids)

    assert bare(Overrides).request_finished(never, []) == (False, None)


def runner_class() -> type:
    return importlib.import_module(RUNNER_MODULE).CPUModelRunner  # type: ignore[no-any-return]


@pytest.mark.applies("cpu-zero-blocks")
@pytest.mark.parametrize("how", ["stand-in as self", "override calling super()", "per-group lists"])
def test_zeroing_however_called(patched: Any, how: str) -> None:
    cls = runner_class()
    runner, bufs = zero_checks.cpu_runner_case(cls)
    if how == "stand-in as self":
        # no num_blocks on the config: the first axis is the block axis, as upstream indexes
        stub = SimpleNamespace(
            kv_cache_config=SimpleNamespace(kv_cache_groups=runner.kv_cache_config.kv_cache_groups),
            compilation_config=runner.compilation_config,
        )
        cls._zero_block_ids(stub, [2, 5])
        assert zero_checks.zeroed_blocks(bufs["attention"]) == [2, 5]
    elif how == "override calling super()":

        class Runner(cls):  # type: ignore[misc, valid-type]
            def _zero_block_ids(self, block_ids: Any) -> None:
                super()._zero_block_ids(block_ids)

        sub = Runner.__new__(Runner)
        sub.__dict__.update(runner.__dict__)
        sub._zero_block_ids(block_ids=[2, 5])
        assert zero_checks.zeroed_blocks(bufs["attention"]) == [2, 5]
    else:
        groups = runner.kv_cache_config.kv_cache_groups
        per_group = [[3] if i == 1 else [] for i in range(len(groups))]  # group 1: attention
        runner._zero_block_ids(per_group)
        assert zero_checks.zeroed_blocks(bufs["attention"]) == [3]
        if "hidden" in bufs:  # its own group got no ids
            assert bool(bufs["hidden"].isnan().all())
    assert bool(torch.isnan(bufs["attention"][[0, 1, 4, 6, 7]]).all())
