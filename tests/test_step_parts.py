"""The optimizer stepped part by part as syncs land (Trainer._step_as_synced): the same bits as one step."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.train.apply import PER_PARAMETER_OPTIMIZERS, step_some

SETTINGS = {
    torch.optim.SGD: [
        {"lr": 0.1},
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    ],
    torch.optim.Adam: [{"lr": 0.01}, {"lr": 0.01, "amsgrad": True, "weight_decay": 1e-2}],
    torch.optim.AdamW: [{"lr": 0.01}],
    torch.optim.Adagrad: [{"lr": 0.1, "lr_decay": 0.01}],
    torch.optim.RMSprop: [{"lr": 0.01, "momentum": 0.5, "centered": True}],
    torch.optim.Adamax: [{"lr": 0.01}],
    torch.optim.NAdam: [{"lr": 0.01}],
    torch.optim.RAdam: [{"lr": 0.01}],
    torch.optim.Adadelta: [{"lr": 1.0}],
}


def test_every_per_parameter_optimizer_has_settings_here():
    assert set(SETTINGS) == set(PER_PARAMETER_OPTIMIZERS)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(SETTINGS, key=lambda c: c.__name__)),
    which=st.integers(0, 2),
    parts=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    two_groups=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_steps_on_the_parts_of_a_partition_give_the_bits_of_one_step(kind, which, parts, two_groups, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (5,), (4, 5), (4,), (2, 4), (2,)]
    params = [torch.randn(*s, generator=gen, requires_grad=True) for s in shapes]
    twins = [p.detach().clone().requires_grad_(True) for p in params]
    options = SETTINGS[kind][which % len(SETTINGS[kind])]

    def make(ps):
        groups = [{"params": ps[:3]}, {"params": ps[3:], "lr": options["lr"] / 2}] if two_groups else [{"params": ps}]
        opt = kind(groups, **options)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    whole, whole_sched = make(params)
    parted, parted_sched = make(twins)
    for _ in range(3):
        grads = [torch.randn(*s, generator=gen) for s in shapes]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        whole.step()
        done: set = set()
        for part in sorted(set(parts)):  # the parts in the order their syncs land
            ids = {id(t) for t, k in zip(twins, parts) if k == part}
            step_some(parted, ids, keep=True)
            done |= ids
        step_some(parted, done, keep=False)  # the rest (none here): what _apply steps last
        whole_sched.step()
        parted_sched.step()
    for p, t in zip(params, twins):
        assert p.detach().numpy().tobytes() == t.detach().numpy().tobytes()
    a, b = whole.state_dict(), parted.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for name, value in a["state"][i].items():
            other = b["state"][i][name]
            if torch.is_tensor(value):
                assert value.numpy().tobytes() == other.numpy().tobytes(), (i, name)
            else:
                assert value == other, (i, name)


def test_a_part_leaves_the_optimizer_s_groups_as_they_were():
    ps = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    opt = torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.5}], lr=0.1)
    before = copy.copy(opt.param_groups)
    for p in ps:
        p.grad = torch.ones_like(p)
    step_some(opt, {id(ps[1])}, keep=True)
    assert opt.param_groups == before and opt.param_groups[1]["params"][0] is ps[1]
    assert ps[0].detach().tolist() == [0.0, 0.0] and ps[1].detach().tolist() == [-0.5] * 3
