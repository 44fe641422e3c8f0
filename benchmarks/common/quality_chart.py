"""The learning curves of benchmarks/quality.py as an SVG chart, written without a plotting
package (none is installed where the benchmark runs): held-out score against step, one
line per configuration, fp32's quality target as a dashed line."""

from html import escape

WIDTH, HEIGHT = 760, 420
LEFT, RIGHT, TOP, BOTTOM = 60, 230, 30, 50  # margins; the legend sits in the right one
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / (count - 1) if high > low else 1.0
    return [low + i * step for i in range(count)]


def svg(title: str, metric: str, curves: dict[str, dict[int, float]], target: float) -> str:
    """curves: configuration -> {step: score}. Returns the SVG document."""
    steps = [s for c in curves.values() for s in c]
    values = [v for c in curves.values() for v in c.values()] + [target]
    x0, x1 = 0, max(steps)
    y0, y1 = min(values), max(values)
    pad = 0.05 * (y1 - y0 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + plot_w * (step - x0) / (x1 - x0)

    def y(value: float) -> float:
        return TOP + plot_h * (1 - (value - y0) / (y1 - y0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="18" font-size="13">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
           f'stroke="#444"/>']
    for v in _ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="#ddd"/><text x="{LEFT - 6}" y="{y(v) + 4:.1f}" '
                   f'text-anchor="end">{v:.2f}</text>')
    for s in _ticks(x0, x1):
        out.append(f'<text x="{x(s):.1f}" y="{TOP + plot_h + 16}" '
                   f'text-anchor="middle">{s:.0f}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">step'
               f'</text><text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {TOP + plot_h / 2})">{escape(metric)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(target):.1f}" '
               f'y2="{y(target):.1f}" stroke="black" stroke-dasharray="6 4"/>')
    for i, (name, curve) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="2 2"' if i >= len(COLORS) else ""
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in sorted(curve.items()))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                   f'stroke-width="1.5"{dash}/>')
        ly = TOP + 6 + 14 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 36}" y1="{ly}" '
                   f'y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>'
                   f'<text x="{WIDTH - RIGHT + 42}" y="{ly + 4}">{escape(name)}</text>')
    ly = TOP + 6 + 14 * len(curves)
    out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 36}" y1="{ly}" y2="{ly}" '
               f'stroke="black" stroke-dasharray="6 4"/><text x="{WIDTH - RIGHT + 42}" '
               f'y="{ly + 4}">fp32\'s quality</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
