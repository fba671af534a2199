"""Float32 master weights for a bfloat16 policy: small AdamW updates are kept, not rounded away."""

import copy

import pytest
import torch

from rlvr.checks import resolve_config
from rlvr.training.optim import MasterWeightAdamW, make_adamw, make_rmsprop


def test_pure_bf16_adamw_loses_small_updates_and_master_weights_keep_them():
    # bf16 has 8 significant bits: around 0.02 (in [2^-6, 2^-5)) its spacing is 2^-13 = 1.22e-4.
    # With a constant gradient AdamW's bias-corrected step is lr * m_hat / (sqrt(v_hat) + eps) = lr
    # (to 1e-8 relative), so after k steps the float32 master sits at w0 - k * 1e-5 exactly.
    w0 = torch.tensor([0.02], dtype=torch.bfloat16)
    plain = w0.clone().requires_grad_()
    kept = w0.clone().requires_grad_()
    opt_plain = torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.0)
    opt_kept = MasterWeightAdamW([kept], lr=1e-5, weight_decay=0.0)
    for _ in range(20):
        for p, o in ((plain, opt_plain), (kept, opt_kept)):
            p.grad = torch.ones_like(p)
            o.step()
            o.zero_grad()
    assert plain.item() == w0.item()  # every 1e-5 step was below half a bf16 spacing: all lost
    master = opt_kept.masters[0]
    assert master.dtype == torch.float32
    # (to float32 rounding: 20 additions at a spacing of 1.9e-9 near 0.02)
    assert master.item() == pytest.approx(w0.float().item() - 20 * 1e-5, abs=4e-8)
    assert kept.item() == master.bfloat16().item()  # the model holds the rounded master
    assert kept.item() < w0.item()  # 2e-4 of movement crossed at least one bf16 spacing
    assert kept.grad is None and master.grad is None


def test_master_weights_follow_float32_adamw_given_the_same_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    bf = copy.deepcopy(lin).bfloat16()
    ref = copy.deepcopy(bf).float()  # float32 model starting from the same (rounded) values
    opt = MasterWeightAdamW(bf.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        x = torch.randn(3, 8)
        bf(x.bfloat16()).float().square().sum().backward()
        for p, q in zip(bf.parameters(), ref.parameters()):
            q.grad = p.grad.float().clone()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for m, q, p in zip(opt.masters, ref.parameters(), bf.parameters()):
        torch.testing.assert_close(m, q.detach(), rtol=0, atol=1e-7)
        assert torch.equal(p.detach(), q.detach().bfloat16())


def test_state_dict_carries_the_masters_so_resume_is_exact():
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4).bfloat16()
    opt = MasterWeightAdamW(model.parameters(), lr=1e-5)

    def step(m, o, seed):
        g = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        o.step()
        o.zero_grad()

    for s in range(3):
        step(model, opt, s)
    saved_model = copy.deepcopy(model)
    saved = copy.deepcopy(opt.state_dict())
    assert all(w is not None and w.dtype == torch.float32 for w in saved["master_weights"])
    step(model, opt, 3)  # the uninterrupted run

    restored = saved_model
    opt2 = MasterWeightAdamW(restored.parameters(), lr=1e-5)
    opt2.load_state_dict(saved)
    for m2, m_saved in zip(opt2.masters, saved["master_weights"]):
        assert torch.equal(m2, m_saved)  # not the rounded bf16 values
    step(restored, opt2, 3)
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_make_adamw_uses_masters_only_for_low_precision_parameters():
    f32 = torch.nn.Linear(2, 2)
    assert type(make_adamw(f32.parameters(), lr=1e-3)) is torch.optim.AdamW
    bf = torch.nn.Linear(2, 2).bfloat16()
    assert isinstance(make_adamw(bf.parameters(), lr=1e-3), MasterWeightAdamW)
    assert type(make_adamw(bf.parameters(), master_weights=False, lr=1e-3)) is torch.optim.AdamW
    frozen = torch.nn.Linear(2, 2).bfloat16().requires_grad_(False)
    head = torch.nn.Linear(2, 2)
    opt = make_adamw(list(frozen.parameters()) + list(head.parameters()), lr=1e-3)
    assert type(opt) is torch.optim.AdamW  # frozen bf16 weights are not optimized at all


def test_trainer_steps_a_bf16_policy_through_master_weights(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    from rlvr.commands.train import _optimizer_and_scheduler
    from rlvr.config import DataConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig

    cfg = resolve_config(
        TrainConfig(
            data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
            rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=4),
            optim=OptimConfig(lr=1e-5, gradient_accumulation_steps=1),
            log=LogConfig(progress=False),
            n_steps=1,
        )
    )
    model = copy.deepcopy(tiny_model).bfloat16()
    opt, _ = _optimizer_and_scheduler(cfg, model, torch.device("cpu"))
    assert isinstance(opt, MasterWeightAdamW)
    opt, _ = _optimizer_and_scheduler(cfg, copy.deepcopy(tiny_model), torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW


def test_master_weight_rmsprop_steps_tensor_by_tensor_unless_asked():
    """DPO's master-weight RMSprop uses the per-tensor update (its temporaries are one tensor's size),
    and the same update as the multi-tensor one; an explicit ``foreach`` still wins."""
    torch.manual_seed(0)
    weights = [torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    copies = [w.detach().clone().requires_grad_(True) for w in weights]
    per_tensor = make_rmsprop(weights, master_weights=True, lr=1e-2)
    multi = make_rmsprop(copies, master_weights=True, lr=1e-2, foreach=True)
    assert per_tensor.defaults["foreach"] is False and multi.defaults["foreach"] is True
    for _ in range(3):
        for a, b in zip(weights, copies):
            grad = torch.randn(4, 3, dtype=torch.bfloat16)
            a.grad, b.grad = grad.clone(), grad.clone()
        per_tensor.step()
        multi.step()
    for a, b in zip(weights, copies):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
