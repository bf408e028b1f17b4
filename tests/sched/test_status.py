"""A request's status is one enum from the scheduler to the output and the counters: the finished values are the
spellings of ``DiffusionOutput.status``, and the status names the engine counter it adds to."""

from __future__ import annotations

from omni_core.sched import DiffusionRequestStatus as S


def test_the_finished_statuses_are_the_output_statuses_and_name_their_counters():
    assert [S.of_output(s) for s in ("completed", "aborted", "error", "anything else")] == [
        S.FINISHED_COMPLETED, S.FINISHED_ABORTED, S.FINISHED_ERROR, S.FINISHED_ERROR]
    assert S.FINISHED_COMPLETED == "completed" and f"{S.FINISHED_ABORTED}" == "aborted"
    assert [s.counter for s in (S.FINISHED_COMPLETED, S.FINISHED_ABORTED, S.FINISHED_ERROR)] == [
        "requests_completed", "requests_aborted", "requests_failed"]
    assert [s.finished for s in S] == [False, False, False, True, True, True]
