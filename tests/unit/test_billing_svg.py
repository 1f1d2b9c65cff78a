"""The SVG charts: scales, stacking, escaping and empty data."""

import re

import pytest

from billing.svg import Series, bar_chart, compact, hbar_chart, line_chart, nice_ticks


def _rect_heights(svg: str) -> list[float]:
    return [float(h) for h in re.findall(r'<rect [^>]*height="([\d.]+)"', svg)]


@pytest.mark.parametrize(
    ("top", "ticks"),
    [
        (10, [0, 2, 4, 6, 8, 10]),
        (9.3, [0, 2, 4, 6, 8, 10]),
        (0.17, [0, 0.05, 0.1, 0.15, 0.2]),
        (1234, [0, 500, 1000, 1500]),
        (0, [0, 1]),
    ],
)
def test_ticks_are_round_and_reach_the_top(top: float, ticks: list[float]) -> None:
    assert nice_ticks(top) == ticks


def test_compact_labels() -> None:
    assert [compact(v) for v in (0, 12, 1234, 2_500_000, 3e9, 0.00005, 0.25)] == [
        "0",
        "12",
        "1.23k",
        "2.5M",
        "3G",
        "0.00005",
        "0.25",
    ]


def test_grouped_bars_are_proportional_to_their_values() -> None:
    svg = bar_chart(["a", "b"], [Series("x", [10, 5]), Series("y", [2.5, 0])])

    heights = _rect_heights(svg)  # order: a/x, a/y, b/x, b/y
    assert heights[0] == pytest.approx(2 * heights[2], rel=0.01)
    assert heights[0] == pytest.approx(4 * heights[1], rel=0.01)
    assert heights[3] == 0


def test_stacked_bars_add_up() -> None:
    stacked = bar_chart(["a"], [Series("x", [3]), Series("y", [1])], stacked=True)
    alone = bar_chart(["a"], [Series("x", [4])])

    assert sum(_rect_heights(stacked)) == pytest.approx(_rect_heights(alone)[0], rel=0.01)
    assert "legend" in stacked and "legend" not in alone  # a key only when it tells apart


def test_text_from_data_is_escaped() -> None:
    svg = bar_chart(["<b>"], [Series("</svg><script>", [1])])
    svg += hbar_chart(["a&b"], [1.0]) + line_chart(["t"], [Series("<x>", [1])])

    assert "<script>" not in svg and "<b>" not in svg
    assert "&lt;/svg&gt;&lt;script&gt;" in svg and "a&amp;b" in svg


def test_empty_data_draws_a_note() -> None:
    for svg in (bar_chart([], []), line_chart([], []), hbar_chart([], [])):
        assert "no data in this window" in svg


def test_line_points_follow_the_values() -> None:
    svg = line_chart(["1", "2", "3"], [Series("s", [0, 10, 5])])

    ys = [float(y) for y in re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)"', svg)]
    assert ys[0] > ys[2] > ys[1]  # SVG y grows downwards


def test_hbars_share_a_maximum() -> None:
    svg = hbar_chart(["a", "b"], [0.5, 0.25], maximum=1.0)

    widths = [float(w) for w in re.findall(r'<rect [^>]*width="([\d.]+)"', svg)]
    assert widths[0] == pytest.approx(2 * widths[1], rel=0.01)
    assert widths[0] == pytest.approx((640 - 290) / 2, rel=0.01)
