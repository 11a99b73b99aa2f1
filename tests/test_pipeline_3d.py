"""3-D parallelism: (pp, dp, tp) = (2, 2, 2) with ZeRO-1 on dp matches one process on Tiny Shakespeare
(8 ranks; the other 3-D layout, (2, 1, 2) interleaved, is in test_pipeline_parallel.py)."""
import pytest

from conftest import shakespeare
from podscale.runtime.launcher import launch
from test_pipeline_parallel import GLOBAL_BATCH, MODEL, STEPS, ZERO1, _cfg, _check_all
from reference import reference_run
from tp_workers import make_config, train_layouts


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_config(shakespeare(), STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 1, model=MODEL))


def test_3d_222_zero1(reference):
    layouts = [("(pp,dp,tp)=(2,2,2) 1f1b ZeRO-1", _cfg(8, 2, pp=2, dp=2, tp=2, zero=ZERO1))]
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=8)
    _check_all(layouts, results, reference, 8)
    c = results[0][0]["comm"]
    # every axis carried traffic, and the metrics show each
    assert c["tp/all_reduce"]["calls"] > 0 and c["pp/send"]["calls"] > 0 and c["dp/reduce_scatter"]["calls"] > 0
