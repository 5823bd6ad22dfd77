"""The one stack walker that finds the user's line."""

from __future__ import annotations

import os
import sys

from ddpgraph._frames import PACKAGE_DIR, frame_outside, in_directories, in_modules


def _inner(inside):
    return frame_outside(inside)


def _outer(inside):
    return _inner(inside)


def test_the_first_frame_outside_is_found_with_its_warning_stacklevel():
    here = in_modules({__name__})
    frame, level = _outer(lambda f: f.f_code.co_name in ("_inner", "_outer"))
    assert (
        frame.f_code.co_name == "test_the_first_frame_outside_is_found_with_its_warning_stacklevel"
    )
    assert level == 3  # 1: _inner (the caller), 2: _outer, 3: this test
    frame, level = _outer(lambda f: False)
    assert (frame.f_code.co_name, level) == ("_inner", 1)
    outermost, _ = _outer(here)  # every frame of this module is inside: the walk goes on
    assert outermost.f_back is None or not here(outermost)


def test_directories_are_compared_by_absolute_path():
    this_file = os.path.abspath(__file__)
    frame = sys._getframe()
    assert in_directories(os.path.dirname(this_file) + os.sep)(frame)
    assert in_directories(this_file)(frame)
    assert not in_directories(PACKAGE_DIR)(frame)
    assert PACKAGE_DIR.endswith(os.path.join("ddpgraph", ""))
