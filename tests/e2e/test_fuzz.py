"""A seeded sample of the property-based fuzzer (tests/fuzz_messages.py) against a real guard:
no UNKNOWN or INTERNAL answer, no traceback in the logs, correct answers afterwards. The
benchmark (benchmarks/reliability.py) runs 10,000+ cases against `guard serve`."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fixture_models import Affine
from fuzz_messages import Target, cases, reset_routes, target_models
from support import Tracebacks, affine_backend, running

TAP = {"host": "127.0.0.1", "port": 0}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    with running(folder, target_models(affine_backend()), tap=TAP) as (srv, _):
        target = Target(srv.grpc_port, srv.tap_port, srv.admin_port)
        yield target
        target.close()


def test_fuzzed_messages_get_deliberate_answers(target):
    with Tracebacks() as tracebacks:
        @settings(max_examples=200, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def one(case):
            target.send(case)

        one()
    reset_routes(target)
    assert sum(target.codes.values()) >= 200
    assert any(k.endswith(" OK") for k in target.codes)  # some calls were valid ones
    assert any(not k.endswith(" OK") for k in target.codes)  # and some were refused
    assert tracebacks.messages == []
    assert target.answers_correctly(Affine())
