"""`plan --search`: the bisection over per-chip batches and remat policies, on a stand-in for the compiler."""

import dataclasses

from systolic.plan import search as plan_search

# Sequences per chip that fit in memory with each policy, as a compiler would find them.
FITS_UP_TO = {"none": 4, "dots": 8, "full": 32}


@dataclasses.dataclass(frozen=True)
class FakePlan:
    fits: bool
    step_time_s: float
    peak_bytes: int = 2**30
    items_per_s: float = 1.0
    item_unit: str = "tok"
    compile_s: float = 1.0


def test_search_bisects_each_policy_from_what_the_one_before_fitted(monkeypatch):
    compiled = []

    def fake_plan_step(workload, plan_fn, cfg, target, **kwargs):
        remat, batch = cfg
        compiled.append(cfg)
        per_chip = batch // 4
        return FakePlan(fits=per_chip <= FITS_UP_TO[remat], step_time_s={"none": 1.0, "dots": 1.1, "full": 1.3}[remat])

    monkeypatch.setattr(plan_search, "plan_step", fake_plan_step)
    tried = plan_search.search("lm", None, None, None, mesh="fsdp=4", data_parallel=4, grad_accum=1,
                               remats=("none", "dots", "full"), configure=lambda cfg, remat, batch: (remat, batch))
    assert len(compiled) == len(set(compiled)), "a candidate was compiled twice"
    assert [(c.remat, c.per_chip) for c in tried] == [
        ("none", 8), ("none", 2), ("none", 4),  # bisection over 1..64: 8 no, 2 yes, 4 yes
        ("dots", 16), ("dots", 8),  # from 4 (known to fit with less recomputation) up: 16 no, 8 yes
        ("full", 32), ("full", 64),  # from 8: 32 yes, 64 no; 16 needs no compile
    ]
    chosen = plan_search.best(tried)
    assert (chosen.remat, chosen.per_chip, chosen.batch) == ("full", 32, 128)
    assert "largest batch that fits: 32 per chip (128 in all) with model.remat=full" in \
        plan_search.format_search(tried, 16 * 2**30)
