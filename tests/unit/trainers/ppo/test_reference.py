"""The offloaded reference swap (``ReferencePolicy.swapped_in``) is exception-safe.

An error part-way through copying the reference weights into the backbone, inside the
``with`` body, or part-way through copying the actor's weights back must leave the actor
bit-identical (in fp32 the optimizer's master weights are these very tensors).
"""

from __future__ import annotations

import pytest
import torch

from tests.single_rank import single_rank

VOCAB = 64


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _actor_and_reference(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    model = build_model(load_model_preset("tiny", vocab_size=VOCAB), dims, seed=3)
    ref = ReferencePolicy(model, "offload", zero_copy=False)  # the copy path (CUDA's)
    with torch.no_grad():  # the actor moves away from the reference
        for p in model.parameters():
            p.add_(0.01)
    return model, ref


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bit_identical(model, before: dict) -> None:
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, f"actor weights left changed: {changed}"


class _Boom(RuntimeError):
    pass


class _FailingCopy:
    """Stands in for one host tensor: copying from/into it raises (a failed transfer)."""

    def __init__(self, like: torch.Tensor):
        self.like = like

    def __getattr__(self, name):
        return getattr(self.like, name)

    def copy_(self, *args, **kwargs):
        raise _Boom("injected copy failure")


def test_failure_after_the_first_copied_tensor_of_swap_in_leaves_the_actor_bit_identical(dims):
    model, ref = _actor_and_reference(dims)
    before = _snapshot(model)
    names = list(ref.ref)
    # the second reference tensor cannot be copied in: a wrong shape fails the copy_
    good = ref.ref[names[1]]
    ref.ref[names[1]] = torch.zeros(good.numel() + 1, dtype=good.dtype)
    with pytest.raises(RuntimeError):
        with ref.swapped_in():
            pytest.fail("the body must not run when the swap-in failed")
    _assert_bit_identical(model, before)
    ref.ref[names[1]] = good
    with ref.swapped_in() as m:  # and the policy still works afterwards
        assert m is model
        assert torch.equal(dict(model.named_parameters())[names[1]], good)
    _assert_bit_identical(model, before)


def test_failure_stashing_a_later_tensor_leaves_the_actor_bit_identical(dims):
    model, ref = _actor_and_reference(dims)
    before = _snapshot(model)
    names = list(ref.stash)
    ref.stash[names[2]] = _FailingCopy(ref.stash[names[2]])
    with pytest.raises(_Boom):
        with ref.swapped_in():
            pytest.fail("the body must not run when the swap-in failed")
    _assert_bit_identical(model, before)


def test_error_in_the_body_restores_the_actor_bit_identically(dims):
    model, ref = _actor_and_reference(dims)
    before = _snapshot(model)
    with pytest.raises(_Boom):
        with ref.swapped_in():
            raise _Boom("forward failed")
    _assert_bit_identical(model, before)


def test_failure_restoring_one_tensor_still_restores_all_others_and_raises(dims):
    model, ref = _actor_and_reference(dims)
    before = _snapshot(model)
    params = dict(model.named_parameters())
    names = list(ref.stash)
    victim = names[1]
    with pytest.raises(_Boom):
        with ref.swapped_in():
            # swap-out: copying the actor's weights back into this parameter fails
            real = params[victim]
            real_copy = real.copy_
            calls = {"n": 0}

            def failing_copy_(src, *a, **kw):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise _Boom("injected restore failure")
                return real_copy(src, *a, **kw)

            real.copy_ = failing_copy_
    del params[victim].copy_
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == [victim], changed  # only the tensor whose copy failed is not restored


def test_on_the_host_the_swap_exchanges_storage_without_a_stash(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    model = build_model(load_model_preset("tiny", vocab_size=VOCAB), dims, seed=3)
    initial = _snapshot(model)
    ref = ReferencePolicy(model, "offload")  # the model is in host memory: zero-copy
    copying = ReferencePolicy(model, "offload", zero_copy=False)
    assert ref.zero_copy and not ref.stash
    assert 2 * ref.host_bytes() == copying.host_bytes() > 0
    with torch.no_grad():  # the actor moves away from the reference
        for p in model.parameters():
            p.add_(0.01)
    before = _snapshot(model)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    with ref.swapped_in() as m:
        assert m is model
        for n, p in model.named_parameters():
            expected = initial[n] if not n.startswith("value_head.") else before[n]
            assert torch.equal(p, expected), n
    _assert_bit_identical(model, before)
    assert pointers == {n: p.data_ptr() for n, p in model.named_parameters()}  # its own tensors back
    with pytest.raises(_Boom):
        with ref.swapped_in():
            raise _Boom("forward failed")
    _assert_bit_identical(model, before)
    with ref.swapped_in():  # and the reference weights survived both round trips
        assert all(torch.equal(p, initial[n]) for n, p in model.named_parameters()
                   if not n.startswith("value_head."))


def test_zero_copy_needs_the_parameters_in_host_memory():
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    on_meta = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="not in host memory"):
        ReferencePolicy(on_meta, "offload", zero_copy=True)


def test_dims_device_decides_the_swap_an_accelerator_takes_the_copy_path():
    from nemo_rlhf.distributed.device_guard import EMULATED_DEVICE
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    model = torch.nn.Linear(2, 2)  # in host memory either way
    assert ReferencePolicy(model, "offload", device=torch.device("cpu")).zero_copy
    on_accelerator = ReferencePolicy(model, "offload", device=EMULATED_DEVICE)  # the guard's cpu:0
    assert not on_accelerator.zero_copy and set(on_accelerator.stash) == {"weight", "bias"}
    with pytest.raises(ValueError, match="not in host memory"):
        ReferencePolicy(model, "offload", zero_copy=True, device=EMULATED_DEVICE)


def test_adapters_off_is_the_base_and_keeps_no_weights(dims):
    """``reference.mode=adapters_off``: the reference pass is the actor's own stage with the
    adapters skipped (the base's logits exactly), the adapters back on after it (also after
    an error), no weights kept; refused on a model without adapters."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.lora import adapters
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    base = build_model(load_model_preset("tiny", vocab_size=VOCAB), dims, seed=3).eval()
    model = build_model(load_model_preset("tiny", vocab_size=VOCAB, lora={"enabled": True, "rank": 2}),
                        dims, seed=3).eval()
    with torch.no_grad():
        for a in adapters(model):
            a.lora_b.normal_()
        want = model_forward(base, ids, mask, with_values=False)
        ref = ReferencePolicy(model, "adapters_off")
        assert ref.weight_bytes() == 0 and ref.host_bytes() == 0
        with ref.swapped_in() as m:
            assert m is model and torch.equal(model_forward(m, ids, mask, with_values=False), want)
        assert all(a.enabled for a in adapters(model))
        assert not torch.equal(model_forward(model, ids, mask, with_values=False), want)
        with pytest.raises(RuntimeError, match="boom"), ref.swapped_in():
            raise RuntimeError("boom")
        assert all(a.enabled for a in adapters(model))
    with pytest.raises(ValueError, match="reference.mode=adapters_off: the model has no LoRA adapters"):
        ReferencePolicy(base, "adapters_off")
