"""What a claim costs does not grow with the study (issue 21, item 1).

A runner that read the whole study's folder before every claim paid for every trial already
run: 2.0 s for the first 100 of 600 trials, 12.8 s for the last 100. Nothing here times
anything: the real FolderStore is instrumented (a subclass) to count what each claim makes
it do (scans, folder entries listed, records read, stamps, writes), and the count for the
last claims of a 2,000-trial study must be bounded by a constant, as for the first ones.
"""

from __future__ import annotations

import itertools
import threading

import pytest

pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

from optuna.distributions import FloatDistribution  # noqa: E402

from somatize import FolderStore  # noqa: E402
from somatize.study import Study  # noqa: E402

X = {"x": FloatDistribution(-5.0, 5.0)}
TRIALS = 2000
WINDOW = 100
# What one claim may cost, on average over any hundred consecutive claims of two runners:
# reading again the trials last seen running (its own, the other's), reading the trials the
# other claimed meanwhile, one look at a free number, the fence looked at before a result is
# written, and now and then a judge's stamps.
PER_CLAIM = {"scans": 8, "listed": 8, "records": 8, "stamps": 4, "looks": 4}
# Far above that, far below a whole study: a claim that gets here read the folder through.
TOO_DEAR = 400


def instant(trial):
    """Returns at once: what is counted is claiming and writing, never the work."""
    return (trial.config["x"] - 1.0) ** 2


class TooDear(BaseException):
    """One claim read more than a study-independent claim ever needs (raised to stop at once)."""


class Counting(FolderStore):
    """The real FolderStore, counting what a runner asks of it between two of its claims."""

    order = itertools.count()

    def __init__(self, path) -> None:
        super().__init__(path)
        self.now = dict.fromkeys(PER_CLAIM, 0)
        self.claims: list[tuple[int, dict[str, int]]] = []  # (when, what that claim cost)

    def _spend(self, what: str, many: int = 1) -> None:
        self.now[what] += many

    def scan(self, prefix):
        self._spend("scans")
        for found in super().scan(prefix):
            self._spend("records")
            yield found

    def scan_names(self, names):  # a read of names known (a trial's attempts): one scan too
        self._spend("scans")
        for found in super().scan_names(names):
            self._spend("records")
            yield found

    def _list(self, folder, base, partial, names):
        import os

        self._spend("listed", len(os.listdir(folder)))  # every entry the listing reads
        return super()._list(folder, base, partial, names)

    def stamp(self, name):
        self._spend("stamps")
        return super().stamp(name)

    def holder(self, name):
        self._spend("looks")
        return super().holder(name)

    def create(self, name, record, blob=None, *, durable=True):
        if name.endswith(".000") and max(self.now.values()) > TOO_DEAR:
            raise TooDear(f"a claim cost {self.now}: it read the study's folder through")
        made = super().create(name, record, blob, durable=durable)
        if made and name.endswith(".000"):  # a trial claimed: what it cost, then afresh
            self.claims.append((next(self.order), self.now))
            self.now = dict.fromkeys(PER_CLAIM, 0)
        return made


@pytest.mark.timeout(600)
def test_the_last_claims_of_2000_trials_cost_what_the_first_ones_did(tmp_path):
    Study(
        FolderStore(tmp_path / "store"),
        "long",
        objective=instant,
        space=X,
        trials=TRIALS,
        sampler="random",
        patience=30,
    )
    stores = [Counting(tmp_path / "store") for _ in range(2)]
    ended: list[object] = []

    def runner(store: Counting, name: str) -> None:
        try:
            ended.append(Study.open(store, "long").run(runner=name))
        except BaseException as exc:  # noqa: BLE001 - said by the test below
            ended.append(exc)

    threads = [threading.Thread(target=runner, args=(store, f"r{i}")) for i, store in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    problems = [e for e in ended if isinstance(e, BaseException)]
    assert not problems, problems[0]
    assert sum(counts["done"] for counts in ended) == TRIALS
    assert all(counts["done"] > 0 for counts in ended)  # both took part

    claims = [cost for _, cost in sorted(claim for store in stores for claim in store.claims)]
    assert len(claims) == TRIALS
    for start in range(0, TRIALS - WINDOW + 1, WINDOW):
        window = claims[start : start + WINDOW]
        for what, most in PER_CLAIM.items():
            spent = sum(cost[what] for cost in window)
            assert spent <= most * WINDOW, (
                f"claims {start} to {start + WINDOW - 1} cost {spent} {what}, more than {most} a claim"
            )
    first, last = claims[:WINDOW], claims[-WINDOW:]
    for what in PER_CLAIM:  # the last hundred of 2,000 cost what the first hundred did
        assert sum(c[what] for c in last) <= 1.5 * sum(c[what] for c in first) + WINDOW, what


@pytest.mark.timeout(300)
def test_alone_a_runner_looks_at_one_number_per_claim(tmp_path):
    store = Counting(tmp_path / "store")
    study = Study(store, "alone", objective=instant, space=X, trials=300, sampler="random", patience=30)
    assert study.run(runner="me")["done"] == 300
    costs = [cost for _, cost in store.claims]
    assert len(costs) == 300
    # after the first (which read the whole, empty, study): the fence looked at before the
    # previous trial's result was written (a look), and one free number looked at (a scan,
    # nothing there); what it wrote itself it does not read back
    assert all(cost == {"scans": 1, "listed": 0, "records": 0, "stamps": 0, "looks": 1} for cost in costs[1:]), costs[
        1:5
    ]
