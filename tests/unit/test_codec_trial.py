"""``comm.codec=auto``'s decision (``poise.comm.trial.CodecTrial``), without processes."""

from __future__ import annotations

import pytest

from poise.comm.trial import CodecTrial


def _run(trial: CodecTrial, uncompressed_s: float, codec_s: float) -> None:
    for step in range(trial.end):
        assert trial.uses_codec(step) == (step >= trial.start)  # the trial compresses from start on
        trial.observe(step, uncompressed_s if step < trial.start else codec_s)


def test_the_codec_stays_only_if_it_is_faster_by_the_margin():
    fast = CodecTrial(5, steps=4, margin=1.25)
    _run(fast, uncompressed_s=1.2, codec_s=0.5)
    assert fast.ready and fast.medians() == (1.2, 0.5)
    assert fast.decide(*fast.medians()) and fast.uses_codec(100)
    slow = CodecTrial(5, steps=4, margin=1.25)
    _run(slow, uncompressed_s=0.53, codec_s=0.48)  # faster per step, but not by 25 %
    assert not slow.decide(*slow.medians()) and not slow.uses_codec(100)
    assert slow.summary()["uses_codec"] is False and slow.summary()["codec_step_s"] == 0.48


def test_the_first_steps_and_the_first_trial_step_are_not_timed():
    trial = CodecTrial(5, steps=4)
    for step, seconds in enumerate([9.0, 9.0, 1.0, 1.0, 1.0, 7.0, 0.5, 0.5, 0.5]):
        trial.observe(step, seconds)
    assert trial.uncompressed_s == [1.0, 1.0, 1.0] and trial.codec_s == [0.5, 0.5, 0.5]
    assert trial.ready


def test_the_choice_survives_a_checkpoint():
    trial = CodecTrial(5, steps=3)
    _run(trial, 1.0, 0.2)
    trial.decide(*trial.medians())
    restored = CodecTrial(5, steps=3)
    restored.load_state_dict(trial.state_dict())
    assert restored.choice is True and restored.decided_from == (1.0, 0.2) and not restored.ready


@pytest.mark.parametrize(("start", "steps", "margin", "message"), [
    (2, 8, 1.25, "start_step=2 must be > 2"), (5, 1, 1.25, "auto_trial_steps=1"), (5, 8, 0.9, "auto_margin=0.9"),
])
def test_bad_settings_are_refused(start, steps, margin, message):
    with pytest.raises(ValueError, match=message):
        CodecTrial(start, steps=steps, margin=margin)
