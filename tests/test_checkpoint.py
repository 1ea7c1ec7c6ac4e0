"""Activation checkpointing against the uncheckpointed model.

Tolerances: float64 throughout. Outputs, losses and gradients use rtol 1e-12, atol 1e-12: the
recomputation runs the same ops on the same inputs with the same RNG state, so any difference
beyond rounding noise is a bug. Buffers (BatchNorm running statistics, num_batches_tracked) must be
bit-identical (atol = rtol = 0): the original forward is the only one that may touch them.
Recomputation is counted with FlopCounterMode (exact integers), never timed.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from microbatch.checkpointing import api as ckpt
from microbatch.checkpointing.api import POLICIES, checkpoint, find_blocks
from microbatch.errors import CheckpointError, ConfigError
from microbatch.memory import MemoryTracker

TOL = {"rtol": 1e-12, "atol": 1e-12}
EXACT = {"rtol": 0.0, "atol": 0.0}


# --------------------------------------------------------------------------------------------------
# Models


class NormBlock(nn.Module):
    """Linear -> BatchNorm -> dropout -> tanh -> Linear, residual; keyword argument, dict output."""

    def __init__(self, width: int = 12, hidden: int = 24) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        pre = self.bn(self.fc(x))
        return {"hidden": x + scale * self.out(torch.tanh(self.drop(pre))), "pre": pre}


class NormNet(nn.Module):
    """Blocks live in a ModuleList two levels down (not at a conventional attribute)."""

    def __init__(self, depth: int = 4, width: int = 12) -> None:
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.trunk = nn.Module()
        self.trunk.stages = nn.ModuleList(NormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stem(x)
        aux = h.new_zeros(())
        for stage in self.trunk.stages:
            out = stage(h, scale=0.5)
            h, aux = out["hidden"], aux + out["pre"].square().mean()
        return self.head(h), aux


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, past_key_value: list[Any] | None = None) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if past_key_value is not None:
            past_key_value.append((k.detach(), v.detach()))  # a cache the block writes into
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        past_key_value: list[Any] | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, int]:
        x = x + gate * self.attn(self.ln_1(x), past_key_value if use_cache else None)
        x = x + self.proj(self.drop(F.gelu(self.fc(self.ln_2(x)))))
        return x, int(use_cache)


class TinyTransformer(nn.Module):
    """Frozen token embedding: the first block's input does not require grad."""

    def __init__(self, depth: int = 3, width: int = 16, vocab: int = 20, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.embed.weight.requires_grad_(False)
        self.gate = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(TransformerBlock(width, 2, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        embeds: torch.Tensor | None = None,
        cache: list[Any] | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        x = self.embed(tokens) if embeds is None else embeds
        for layer in self.layers:
            x, _ = layer(x, self.gate, past_key_value=cache, use_cache=use_cache)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


class TanhBlock(nn.Module):
    """Ends in tanh, which saves its output: a recompute must run the whole forward."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.out(torch.tanh(self.fc(x))))


def mlp_chain(depth: int, width: int, hidden: int) -> nn.Sequential:
    """An MLP of ``depth`` blocks Linear(width, hidden) -> GELU -> Linear(hidden, width)."""
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(depth))
    )


# --------------------------------------------------------------------------------------------------
# Helpers


def norm_net_step(model: NormNet, x: torch.Tensor, seed: int) -> dict[str, Any]:
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out, aux = model(x)
    loss = out.square().mean() + aux
    loss.backward()
    return {"loss": loss.detach(), "out": out.detach(), "input_grad": x.grad}


def transformer_step(model: TinyTransformer, tokens: torch.Tensor, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    return {"loss": loss.detach(), "out": logits.detach()}


def assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    actual_grads = {n: p.grad for n, p in actual.named_parameters()}
    for name, parameter in expected.named_parameters():
        if parameter.grad is None:
            assert actual_grads[name] is None, name
        else:
            torch.testing.assert_close(
                actual_grads[name], parameter.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )
    actual_buffers = dict(actual.named_buffers())
    for name, buffer in expected.named_buffers():
        torch.testing.assert_close(actual_buffers[name], buffer, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


def assert_pristine(model: nn.Module) -> None:
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, name
        assert ckpt._MARKER not in module.__dict__, name


def total_flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------------------------------
# Equivalence with the uncheckpointed model


@pytest.mark.parametrize("policy", POLICIES)
def test_norm_net_matches_uncheckpointed(policy: str) -> None:
    reference = NormNet().double()
    model = copy.deepcopy(reference)
    handle = checkpoint(model, policy=policy)
    assert handle.blocks == [f"trunk.stages.{i}" for i in range(4)]
    assert handle.policies == dict.fromkeys(handle.blocks, policy)
    x = torch.randn(10, 6, dtype=torch.float64)
    for seed in (1, 2):  # two steps: running statistics compound, grads accumulate
        got, want = norm_net_step(model, x, seed), norm_net_step(reference, x, seed)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL)
        assert_same_state(model, reference)
    assert int(model.trunk.stages[0].bn.num_batches_tracked) == 2  # once per training forward

    handle.remove()
    assert_pristine(model)
    got, want = norm_net_step(model, x, 3), norm_net_step(reference, x, 3)
    torch.testing.assert_close(got["input_grad"], want["input_grad"], **TOL)
    assert_same_state(model, reference)


@pytest.mark.parametrize("policy", POLICIES)
def test_transformer_matches_uncheckpointed(policy: str) -> None:
    reference = TinyTransformer().double()
    model = copy.deepcopy(reference)
    handle = checkpoint(model, policy=policy)
    assert handle.blocks == ["layers.0", "layers.1", "layers.2"]
    tokens = torch.randint(0, 20, (3, 7))
    for seed in (5, 6):
        got, want = transformer_step(model, tokens, seed), transformer_step(reference, tokens, seed)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL)
        assert_same_state(model, reference)
    assert reference.layers[0].fc.weight.grad is not None  # frozen embedding, grads still flow

    # input gradients, through inputs that require grad
    embeds = torch.randn(2, 5, 16, dtype=torch.float64)
    grads = []
    for net in (model, reference):
        e = embeds.clone().requires_grad_(True)
        torch.manual_seed(7)
        net(embeds=e).sum().backward()
        grads.append(e.grad)
    torch.testing.assert_close(grads[0], grads[1], **TOL)

    handle.remove()
    assert_pristine(model)
    got, want = transformer_step(model, tokens, 8), transformer_step(reference, tokens, 8)
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    assert_same_state(model, reference)


def test_eval_and_no_grad_calls_pass_through() -> None:
    model = NormNet().double().eval()
    reference = copy.deepcopy(model)
    with checkpoint(model):
        x = torch.randn(4, 6, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(model(x)[0], reference(x)[0], **EXACT)
        got, want = norm_net_step(model, x, 0), norm_net_step(reference, x, 0)
        torch.testing.assert_close(got["input_grad"], want["input_grad"], **TOL)
        assert_same_state(model, reference)
    assert_pristine(model)


def test_offload_round_trip_through_host_copies(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """On CPU the offload hooks would keep tensors as they are; force the copy to test the round trip."""
    packed: list[torch.Size] = []
    real_hooks = ckpt._offload_saved_inputs

    def counting_hooks(**_: Any) -> torch.autograd.graph.saved_tensors_hooks:
        hooks = real_hooks(copy_host_tensors=True)
        pack = hooks.pack_hook
        hooks.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]
        return hooks

    monkeypatch.setattr(ckpt, "_offload_saved_inputs", counting_hooks)
    reference = NormNet().double()
    model = copy.deepcopy(reference)
    with caplog.at_level(logging.WARNING, logger="microbatch.checkpointing.api"):
        handle = checkpoint(model, policy="offload")
    if not torch.cuda.is_available():
        assert [r.message for r in caplog.records if "offload" in r.message] != []
    x = torch.randn(10, 6, dtype=torch.float64)
    got, want = norm_net_step(model, x, 1), norm_net_step(reference, x, 1)
    torch.testing.assert_close(got["input_grad"], want["input_grad"], **TOL)
    assert_same_state(model, reference)
    assert packed == [torch.Size([10, 12])] * 4  # each block's boundary input, once
    handle.remove()


def test_cache_is_turned_off_once_for_checkpointed_training(caplog: Any) -> None:
    model = TinyTransformer(dropout=0.0).double()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 20, (2, 5))
    handle = checkpoint(model)
    cache: list[Any] = []
    with caplog.at_level(logging.INFO, logger="microbatch.checkpointing.api"):
        for _ in range(2):
            model(tokens, cache=cache, use_cache=True).sum().backward()
    assert cache == []  # never written, so never written twice
    notices = [r for r in caplog.records if "cache" in r.message]
    assert len(notices) == 1 and notices[0].levelno == logging.INFO
    model.zero_grad()
    reference(tokens).sum().backward()  # the cache-off forward is the plain one
    model(tokens, cache=[], use_cache=True).sum().backward()
    assert_same_state(model, reference)

    with torch.no_grad():  # evaluation / generation: untouched, written once per block
        model(tokens, cache=cache, use_cache=True)
    assert len(cache) == 3
    handle.remove()


# --------------------------------------------------------------------------------------------------
# Recomputation counted exactly


def test_full_policy_adds_exactly_the_checkpointed_forwards() -> None:
    width, hidden, batch = 8, 32, 16
    model = nn.Sequential(*(TanhBlock(width, hidden) for _ in range(5))).double()
    x = torch.randn(batch, width, dtype=torch.float64, requires_grad=True)
    block_forward = total_flops(lambda: model[0](x))
    assert block_forward == 2 * (2 * batch * width * hidden)  # two matmuls, 2 FLOPs per multiply-add
    baseline = total_flops(lambda: model(x).sum().backward())
    for names in (["1"], ["0", "2", "4"]):
        with checkpoint(model, names):
            checkpointed = total_flops(lambda: model(x).sum().backward())
        assert checkpointed - baseline == len(names) * block_forward


def test_recompute_of_a_transformer_block_stops_after_its_last_saved_tensor() -> None:
    """torch stops recomputing once every saved tensor is back: the final projection (whose output
    nothing inside the block saves) is not rerun, so full checkpointing adds the forward minus it."""
    model = TinyTransformer(depth=4, dropout=0.0).double()
    tokens = torch.randint(0, 20, (2, 6))
    layer = model.layers[0]
    x = model.embed(tokens)
    block_forward = total_flops(lambda: layer(x, model.gate))
    final_projection = total_flops(lambda: layer.proj(torch.zeros(2, 6, 64, dtype=torch.float64)))
    baseline = total_flops(lambda: model(tokens).sum().backward())
    with checkpoint(model, ["layers.1", "layers.3"]):
        full = total_flops(lambda: model(tokens).sum().backward())
    assert full - baseline == 2 * (block_forward - final_projection)
    assert block_forward > final_projection > 0


@pytest.mark.parametrize("build", ["tanh", "transformer"])
def test_selective_policy_recomputes_no_matmul(build: str) -> None:
    if build == "tanh":
        model: nn.Module = nn.Sequential(*(TanhBlock(8, 32) for _ in range(4))).double()
        inputs: Any = torch.randn(16, 8, dtype=torch.float64)
    else:
        model, inputs = TinyTransformer(dropout=0.0).double(), torch.randint(0, 20, (2, 6))
    baseline = total_flops(lambda: model(inputs).sum().backward())
    with checkpoint(model, policy="selective"):
        selective = total_flops(lambda: model(inputs).sum().backward())
    with checkpoint(model, policy="full"):
        full = total_flops(lambda: model(inputs).sum().backward())
    assert selective == baseline < full


# --------------------------------------------------------------------------------------------------
# Memory: the saving a hand count predicts


def test_full_checkpointing_cuts_the_peak_by_the_hand_counted_saved_tensors() -> None:
    """8 blocks Linear(d, h) -> GELU -> Linear(h, d) on a batch of B rows, float32 (4 bytes).

    Without checkpointing each block keeps its input (B*d, saved by the first Linear), the first
    Linear's output (B*h, saved by GELU) and GELU's output (B*h, saved by the second Linear). With
    full checkpointing each block keeps only its input. The peak comes as backward starts, in the
    last block: there the checkpointed model has recomputed that block's two B*h tensors, which the
    plain model also holds, and the two runs hold the same temporaries. So

        peak(none) - peak(full) = 7 blocks * 2 tensors * B * h * 4 bytes.

    B * d > 2 * d * h (a block's input outweighs its gradients) keeps the peak at the last block.
    """
    depth, batch, width, hidden = 8, 1024, 32, 128
    base = mlp_chain(depth, width, hidden)
    x = torch.randn(batch, width)
    peaks = {}
    for policy in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        handle = checkpoint(model, policy=policy) if policy != "none" else None
        with MemoryTracker(model=model) as mem:
            model(x).square().sum().backward()
        peaks[policy] = mem.peak_bytes
        if policy == "none":  # the tracker's saved activations are exactly the hand count
            assert mem.breakdown["saved activations"] == depth * (batch * width + 2 * batch * hidden) * 4
        if handle is not None:
            handle.remove()
    predicted_cut = (depth - 1) * 2 * batch * hidden * 4
    measured_cut = peaks["none"] - peaks["full"]
    assert abs(measured_cut - predicted_cut) <= 0.02 * predicted_cut, (measured_cut, predicted_cut)
    assert peaks["full"] <= 0.5 * peaks["none"]
    assert peaks["full"] < peaks["selective"] < peaks["none"]


# --------------------------------------------------------------------------------------------------
# Finding blocks


def test_auto_finds_the_largest_run_wherever_it_lives() -> None:
    model = NormNet(depth=3)
    assert [name for name, _ in find_blocks(model)] == ["trunk.stages.0", "trunk.stages.1", "trunk.stages.2"]

    # a run broken by a different shape; the longer run wins
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU())
    assert [name for name, _ in find_blocks(seq)] == ["2", "3"]

    # equal lengths: more parameters wins
    tie = nn.Module()
    tie.small = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    tie.large = nn.ModuleList([nn.Linear(9, 9), nn.Linear(9, 9)])
    assert [name for name, _ in find_blocks(tie)] == ["large.0", "large.1"]


def test_names_and_predicates_select_blocks() -> None:
    model = TinyTransformer()
    chosen = find_blocks(model, lambda name, module: isinstance(module, Attention))
    assert [name for name, _ in chosen] == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    assert [name for name, _ in find_blocks(model, ["layers.2", "head"])] == ["layers.2", "head"]


def test_policy_dict_gives_each_block_its_own_policy() -> None:
    reference = NormNet().double()
    model = copy.deepcopy(reference)
    policy = {
        "trunk.stages.0": "full",
        "trunk.stages.1": "none",
        "trunk.stages.2": "selective",
        "stem": "offload",
    }
    handle = checkpoint(model, policy=policy)
    assert handle.policies == {"stem": "offload", "trunk.stages.0": "full", "trunk.stages.2": "selective"}
    assert "forward" not in model.trunk.stages[1].__dict__
    x = torch.randn(10, 6, dtype=torch.float64)
    got, want = norm_net_step(model, x, 1), norm_net_step(reference, x, 1)
    torch.testing.assert_close(got["input_grad"], want["input_grad"], **TOL)
    assert_same_state(model, reference)
    handle.remove()
    assert_pristine(model)


def test_remove_restores_an_instance_forward_that_was_there_before() -> None:
    model = NormNet(depth=2)
    block = model.trunk.stages[0]
    custom = functools.partial(NormBlock.forward, block)
    block.forward = custom
    handle = checkpoint(model)
    assert block.forward is not custom
    handle.remove()
    handle.remove()  # idempotent
    assert block.__dict__["forward"] is custom
    assert "forward" not in model.trunk.stages[1].__dict__


# --------------------------------------------------------------------------------------------------
# Bad input: clear errors, model untouched


def test_unknown_block_name_lists_close_matches() -> None:
    model = TinyTransformer()
    with pytest.raises(CheckpointError, match=r"'layer\.1'.*close matches: layers\.1"):
        checkpoint(model, ["layers.0", "layer.1"])
    assert_pristine(model)


def test_unknown_policy_lists_the_options() -> None:
    model = TinyTransformer()
    with pytest.raises(ConfigError, match="'full', 'selective', 'selective-half', 'offload'"):
        checkpoint(model, policy="everything")
    with pytest.raises(ConfigError, match="'none'"):
        checkpoint(model, policy={"layers.0": "sometimes"})
    assert_pristine(model)


def test_nested_checkpointing_is_an_error() -> None:
    model = TinyTransformer()
    with pytest.raises(CheckpointError, match=r"inside 'layers\.0'"):
        checkpoint(model, ["layers.0", "layers.0.attn"])
    assert_pristine(model)

    handle = checkpoint(model)
    with pytest.raises(CheckpointError, match="already checkpointed"):
        checkpoint(model, ["layers.1.attn"])
    with pytest.raises(CheckpointError, match="already checkpointed"):
        checkpoint(model, ["layers.1"])
    with pytest.raises(CheckpointError, match="already checkpointed"):
        checkpoint(model.layers[2], lambda name, module: isinstance(module, Attention))
    with pytest.raises(CheckpointError, match="already checkpointed"):
        checkpoint(model, lambda name, module: name == "layers")
    assert handle.policies == dict.fromkeys(["layers.0", "layers.1", "layers.2"], "full")
    assert sum("forward" in m.__dict__ for m in model.modules()) == 3
    handle.remove()
    assert_pristine(model)
    checkpoint(model, ["layers.1.attn"]).remove()  # allowed again once removed


def test_auto_without_repeated_blocks_says_how_to_name_them() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match=r"no repeated blocks.*blocks=\[") as error:
        checkpoint(model)
    assert "predicate" in str(error.value)
    assert_pristine(model)


def test_other_bad_block_specs() -> None:
    model = TinyTransformer()
    with pytest.raises(CheckpointError, match="selected no submodule"):
        checkpoint(model, lambda name, module: False)
    with pytest.raises(CheckpointError, match=r"\['layers.0'\]"):
        checkpoint(model, "layers.0")
    with pytest.raises(CheckpointError, match="more than once"):
        checkpoint(model, ["layers.0", "layers.0"])
    with pytest.raises(ConfigError, match="policy dict"):
        checkpoint(model, ["layers.0"], policy={"layers.1": "full"})
    assert_pristine(model)


class TensorCacheBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache is not None:
            kv_cache.add_(1.0)  # written on every forward: a recompute would write it twice
        return torch.tanh(self.fc(x))


def test_positional_tensor_cache_is_turned_off() -> None:
    model = nn.ModuleList([TensorCacheBlock(), TensorCacheBlock()])
    cache = torch.zeros(3)
    with checkpoint(model):
        x = torch.randn(2, 4, requires_grad=True)
        model[1](model[0](x, cache), cache).sum().backward()
        assert torch.equal(cache, torch.zeros(3))
        with torch.no_grad():
            model[0](x, cache)
        assert torch.equal(cache, torch.ones(3))


def test_selective_learns_not_to_keep_outputs_its_recompute_never_reaches() -> None:
    """The MLP's output projection feeds only the residual add: the early-stopped recompute never
    reruns it, so from the second step on its output (batch * time * width float64) is not kept."""
    depth, batch, time, width = 3, 4, 8, 16
    model = TinyTransformer(depth=depth, width=width, dropout=0.0).double()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 20, (batch, time))
    handle = checkpoint(model, policy="selective")
    kept_after_forward = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with MemoryTracker(device="cpu", model=model) as mem:
            loss = model(tokens).sum()
            kept_after_forward.append(mem.current_bytes)
            loss.backward()
        del loss
    assert kept_after_forward[0] - kept_after_forward[1] == depth * batch * time * width * 8
    assert kept_after_forward[1] == kept_after_forward[2]
    reference(tokens).sum().backward()
    assert_same_state(model, reference)  # the third step, with the plan learned: still exact

    baseline = total_flops(lambda: reference(tokens).sum().backward())
    assert total_flops(lambda: model(tokens).sum().backward()) == baseline  # no matmul recomputed
    handle.remove()
