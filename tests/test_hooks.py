"""``omni_core.hooks``: named hooks on a module, run in declared order whatever the order they were added in,
removable by name with the module restored exactly, with per-request state through the DenoiseCall (issue #35)."""

from __future__ import annotations

import itertools

import pytest
import torch

from omni_core.forward_context import use_denoise_call
from omni_core.hooks import STAGES, FunctionHook, HookRegistry, ModuleHook, add_hook, get_hook, hook_names, remove_hook
from omni_core.pipelines.state import StepState
from omni_core.request import OmniDiffusionRequest


class Add(ModuleHook):
    """pre_forward: x + k."""

    def __init__(self, k: float, order: int) -> None:
        super().__init__()
        self.k, self.order = k, order

    def pre_forward(self, module, x):
        return (x + self.k,), {}


class Mul(ModuleHook):
    """post_forward: out * k."""

    def __init__(self, k: float, order: int) -> None:
        super().__init__()
        self.k, self.order = k, order

    def post_forward(self, module, out):
        return out * self.k


class Around(ModuleHook):
    """new_forward, diffusers' way: the rest of the chain through ``fn_ref.original_forward``."""

    def __init__(self, order: int) -> None:
        super().__init__()
        self.order = order

    def new_forward(self, module, x):
        return self.fn_ref.original_forward(x * 10) - 1


def lin() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 3)


def make(order_names: tuple) -> dict:
    return {"add": Add(1.0, 10), "mul": Mul(3.0, 20), "around": Around(30), "add2": Add(-2.0, 40)}


def test_order_is_declared_not_who_came_first():
    x = torch.randn(2, 3)
    results, chains = [], []
    for perm in itertools.permutations(["add", "mul", "around", "add2"]):
        m = lin()
        hooks = make(perm)
        for name in perm:
            add_hook(m, name, hooks[name])
        chains.append(hook_names(m))
        results.append(m(x))
    assert all(c == ["add", "mul", "around", "add2"] for c in chains)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    # and it is the declared order: add (outermost) -> mul (post) -> around -> add2 (innermost)
    m = lin()
    expected = m.forward(((x + 1.0) * 10) - 2.0) * 1.0 - 1
    assert torch.equal(results[0], expected * 3.0)


def test_ties_break_by_name_and_order_overrides():
    m = lin()
    add_hook(m, "b", Add(1.0, 5))
    add_hook(m, "a", Add(1.0, 5))
    add_hook(m, "z", Add(1.0, 5), order=1)
    assert hook_names(m) == ["z", "a", "b"]
    with pytest.raises(ValueError, match="already"):
        add_hook(m, "a", Add(1.0, 5))


def test_removal_restores_the_module_exactly():
    x = torch.randn(2, 3)
    m = lin()
    before = dict(m.__dict__)
    ref = m(x)
    hooks = make(())
    for name in ("add", "around", "mul"):
        add_hook(m, name, hooks[name])
    assert not torch.equal(m(x), ref)
    remove_hook(m, "around")  # a middle one: the others still run, in their order
    assert hook_names(m) == ["add", "mul"]
    assert torch.equal(m(x), m.__class__.forward(m, x + 1.0) * 3.0)
    remove_hook(m, "add")
    remove_hook(m, "mul")
    assert m.__dict__ == before and "forward" not in m.__dict__
    assert torch.equal(m(x), ref)
    assert remove_hook(m, "mul", missing_ok=True) is None
    with pytest.raises(KeyError):
        remove_hook(m, "mul")


def test_removing_a_hook_undoes_what_its_initialisation_did():
    """A hook whose ``initialize_hook`` changes the module (the model-offload hook makes itself the module's
    ``_hf_hook``, which diffusers' ``vae.decode`` calls) is taken off by ``remove``: nothing of it stays behind."""
    from omni_core.optimize.model_offload import MODEL_OFFLOAD_HOOK, ModelOffload, OffloadRing

    m = lin()
    before = dict(m.__dict__)
    hook = add_hook(m, MODEL_OFFLOAD_HOOK, ModelOffload(OffloadRing("cpu")))
    assert m._hf_hook is hook
    assert remove_hook(m, MODEL_OFFLOAD_HOOK) is hook
    assert "_hf_hook" not in m.__dict__ and m.__dict__ == before


def test_an_instance_forward_set_before_is_kept_and_put_back():
    x = torch.randn(2, 3)
    m = lin()
    own = m.forward

    def theirs(inp):
        return own(inp) + 100

    m.forward = theirs  # what a library (accelerate, diffusers) might have done before us
    add_hook(m, "mul", Mul(2.0, 1))
    assert torch.equal(m(x), (own(x) + 100) * 2)
    remove_hook(m, "mul")
    assert m.__dict__["forward"] is theirs and HookRegistry.of(m, create=False) is None


def test_two_features_stacked_in_either_order_give_the_same_result():
    """A cache-like hook (outer, skips on a condition) and a kernel-like hook (inner, replaces the forward)."""
    x = torch.randn(4, 3)

    class Skip(ModuleHook):
        order = 200

        def new_forward(self, module, inp):
            return inp if bool(inp.sum() > 100) else self.fn_ref.original_forward(inp)

    class Kernel(ModuleHook):
        order = 600

        def new_forward(self, module, inp):
            return torch.nn.functional.linear(inp, module.weight, module.bias) * 0.5

    outs = []
    for first, second in (("skip", "kernel"), ("kernel", "skip")):
        m = lin()
        made = {"skip": Skip(), "kernel": Kernel()}
        add_hook(m, first, made[first])
        add_hook(m, second, made[second])
        outs.append((m(x), m(x + 1000), hook_names(m)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2] == ["skip", "kernel"]
    assert torch.equal(outs[0][1], x + 1000)


def test_per_request_state_through_the_denoise_call():
    """Two requests share one call; each keeps its own count in its own StepState, nothing on the module."""

    class Count(ModuleHook):
        order = 200

        def __init__(self) -> None:
            super().__init__()
            self.fallback: dict = {}

        def new_forward(self, module, inp):
            out = self.fn_ref.original_forward(inp)
            call = self.current_call(inp.shape[0])
            spans = call.spans() if call is not None else [(None, 0, inp.shape[0])]
            for group, start, stop in spans:
                seen = self.request_state(group, ("count", group.branch if group else "cond"),
                                          lambda: {"n": 0}, self.fallback)
                seen["n"] += 1
                out[start:stop] += seen["n"]
            return out

    m = lin()
    module_keys = set(m.__dict__)
    hook = add_hook(m, "count", Count())
    a = StepState(request=OmniDiffusionRequest(prompt="a"))
    b = StepState(request=OmniDiffusionRequest(prompt="b"))
    x = torch.zeros(3, 3)
    base = m.__class__.forward(m, x)
    with use_denoise_call([(a, 1), (b, 1), (b, 1, "uncond")]):
        first = m(x)
    with use_denoise_call([(b, 1), (a, 1)]):  # b's second call, a's second call, in a new order
        second = m(x[:2])
    assert torch.equal(first - base, torch.tensor([[1.0] * 3, [1.0] * 3, [1.0] * 3]))
    assert torch.equal(second - base[:2], torch.full((2, 3), 2.0))
    assert a.hook_state[("count", "cond")] == {"n": 2}
    assert b.hook_state[("count", "cond")] == {"n": 2} and b.hook_state[("count", "uncond")] == {"n": 1}
    m(x)  # no DenoiseCall: one request, state in the hook's fallback
    assert hook.fallback == {("count", "cond"): {"n": 1}}
    assert set(m.__dict__) - module_keys == {"forward", "_omni_hooks"}


def test_call_below_skips_the_hook_and_follows_later_changes():
    m = lin()
    x = torch.randn(2, 3)
    add_hook(m, "mul", Mul(2.0, 10))
    below = HookRegistry.of(m).call_below("mul")
    assert torch.equal(below(x), m.__class__.forward(m, x))
    add_hook(m, "add", Add(1.0, 20))  # inside "mul": call_below now runs it
    assert torch.equal(below(x), m.__class__.forward(m, x + 1.0))
    assert get_hook(m, "add").k == 1.0


def test_function_hook_gets_the_chain_below_and_takes_its_order():
    m = lin()
    x = torch.randn(2, 3)
    seen = []

    def twice(below, x):  # runs the rest of the chain twice, as a cache computing two variants would
        seen.append(x.shape)
        return below(x) + below(x + 1.0)

    hook = add_hook(m, "twice", FunctionHook(twice))
    assert hook.order == STAGES["cache"] and hook.fn is twice
    add_hook(m, "add", Add(1.0, STAGES["kernel"]))  # inside the function hook: ``below`` runs it
    add_hook(m, "mul", Mul(3.0, STAGES["instrument"]))  # outside it
    assert hook_names(m) == ["mul", "twice", "add"]
    plain = m.__class__.forward
    assert torch.equal(m(x), (plain(m, x + 1.0) + plain(m, x + 2.0)) * 3.0)
    assert seen == [(2, 3)]
    assert FunctionHook(twice, order=7).order == 7 and FunctionHook.order == STAGES["cache"]
    for name in ("mul", "twice", "add"):
        remove_hook(m, name)
    assert "forward" not in m.__dict__
