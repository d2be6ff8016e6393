"""An admin route's whole-number query parameter (``?offset=``, ``?limit=``): anything but a
whole number in range is the route's 400, never a 500."""

from __future__ import annotations

import pytest

from gpupool.gateway.api.admin_routes import count
from gpupool.gateway.errors import InvalidBody


@pytest.mark.parametrize("text", ["²", "1²", "", "-1", "1.0", "9" * 5000, "11"])
def test_a_count_that_is_not_a_whole_number_in_range_is_a_clear_400(text: str) -> None:
    with pytest.raises(InvalidBody) as e:
        count(0, 10)("offset", text)
    assert e.value.param == "offset"


def test_a_count_in_range_reads() -> None:
    assert count(0, 10)("offset", "07") == 7
