"""Chapter 8: a mixture of experts in the GPT, and expert parallelism by hand (gloo)."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from tutorial_utils.bench import experts as bench
from tutorial_utils.config import ConfigError, check
from tutorial_utils.models.gpt import GPT, MLP, GPTConfig, MoE, lm_loss, route
from tutorial_utils.parallel import experts as ep
from tutorial_utils.workers.ep_check import EPCheckConfig

SMALL = GPTConfig(seq=16, layers=2, heads=2, dim=32)
TOL = 1e-5  # fp32; the ranks add the gradients of their tokens in another order


def test_the_dense_gpt_is_the_one_it_was():
    # the numbers of GPT(SMALL) before the experts option existed: experts=0 changes nothing
    assert SMALL.experts == 0
    torch.manual_seed(0)
    model = GPT(SMALL)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert sum(p.numel() for p in model.parameters()) == 42368
    assert not any("router" in n or "experts" in n for n, _ in model.named_parameters())
    assert model(x).double().sum().item() == pytest.approx(-20.246062496214563, abs=1e-4)
    assert model.balance_loss().item() == 0


def test_one_expert_chosen_by_every_token_is_the_dense_mlp():
    torch.manual_seed(0)
    moe, mlp = MoE(16, experts=1, top_k=1), MLP(16)
    mlp.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), mlp(x))  # one softmax gate of one expert: 1


def test_routing_gates_and_the_balance_loss():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 6)
    gates, chosen, balance = route(logits, top_k=2)
    assert chosen.tolist() == [[3, 2]] * 6
    torch.testing.assert_close(gates[0], logits[0].softmax(-1)[[3, 2]])  # not renormalised
    collapsed = route(torch.tensor([[9.0, 0, 0, 0]] * 6), top_k=1)[2]
    spread = route(torch.eye(4).repeat(2, 1) * 9, top_k=1)[2]
    assert collapsed.item() == pytest.approx(4, rel=1e-3)  # E when one expert gets it all
    assert spread.item() == pytest.approx(1, rel=1e-3)  # 1 when tokens and probabilities spread


def test_a_mixture_of_experts_gpt_trains_every_expert_and_the_router():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq=16, layers=2, heads=2, dim=32, experts=4, top_k=2))
    x, y = torch.randint(0, 256, (2, 4, 16))
    logits = model(x)
    assert logits.shape == (4, 16, 256)
    assert model.balance_loss().item() == pytest.approx(2, abs=0.05)  # two blocks, about 1 each
    (lm_loss(logits, y) + 0.01 * model.balance_loss()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["blocks.0.mlp.router.weight"].abs().sum() > 0
    copy.deepcopy(model)  # a copy leaves the last forward's loss and its graph behind


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"experts": 4, "top_k": 5}, "top_k=5 must be between 1 and experts=4"),
    ({"experts": 4, "top_k": 0}, "top_k=0 must be between 1 and experts=4"),
    ({"experts": -1}, "experts=-1 must be >= 0"),
])
def test_a_mixture_it_cannot_build_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


@pytest.mark.parametrize(("args", "message"), [
    ((6, 2, 4, 64), "6 experts do not split over 4 ranks: use a multiple of 4"),
    ((8, 2, 2, 4), "8 experts but 4 token(s) per rank: some experts would get no token"),
    ((2, 3, 2, 64), "top_k=3 is more than the 2 experts"),
])
def test_expert_parallelism_refuses_nonsense_in_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        check(*ep.expert_rules(*args))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_check_refuses_experts_it_cannot_split_before_any_work():
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.ep_check", "--experts",
                           "6", "--device", "cpu"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORLD_SIZE": "4", "RANK": "0"})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.strip().endswith("6 experts do not split over 4 ranks: use a multiple "
                                        "of 4")


def test_the_bytes_arithmetic():
    # 64 tokens, top-2, 32 fp32 values: half the rows leave for the other rank, and come back
    assert ep.predicted_bytes(64, 32, 2, world=2) == 2 * 64 * 2 * 32 * 4 / 2
    assert ep.imbalance([10, 10, 10, 10]) == 1 and ep.imbalance([40, 0, 0, 0]) == 4
    dispatch = ep.Dispatch([3, 5], sent=[3, 5], received=[3, 4], row_bytes=128)
    assert dispatch.bytes_out(rank=0) == (5 + 4) * 128  # rows out, then results back


@pytest.mark.parametrize(("nproc", "experts", "top_k"), [(2, (2, 4), (1, 2)), (4, (8,), (2,))])
def test_expert_parallelism_equals_one_process(nproc, experts, top_k):
    rows = bench.check_rows(nproc, EPCheckConfig(device="cpu", experts=experts, top_k=top_k))
    assert [(r.experts, r.top_k) for r in rows] == [(e, k) for e in experts for k in top_k]
    for r in rows:
        assert max(r.loss_diff, r.out_diff, r.router_grad_diff, r.expert_grad_diff,
                   r.other_grad_diff) < TOL, r
        assert sum(r.per_expert) == r.tokens * r.top_k and r.imbalance >= 1
        assert len(r.bytes_out) == nproc and all(b > 0 for b in r.bytes_out)
        # a router at initialisation spreads the tokens nearly evenly
        assert 0.5 < max(r.bytes_out) / r.predicted_bytes < 1.5
    assert "max/mean" in bench.dispatch_table(rows)
