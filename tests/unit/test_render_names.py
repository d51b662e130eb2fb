"""Names from reports, case files and user models reach the reader as visible characters: one
function (``names.printable``) escapes what a terminal would act on or hide, and every renderer
draws names through it; the tables fit the width they are given without cutting a name, a verdict
or a header."""

from __future__ import annotations

import copy
import dataclasses
import io
import re
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console
from test_render import mixed, tensor

from accumcheck.assertions import failure_message
from accumcheck.render import render, render_console, table_text
from accumcheck.render.fit import shorten
from accumcheck.render.markdown import markdown
from accumcheck.render.names import printable, shown
from accumcheck.render.plots import growth, heatmaps, scatter, trajectory
from accumcheck.render.table import render_cases
from accumcheck.render.wording import one_line, summary_line, tensor_details
from accumcheck.report import FullBatchResult, StackReport, StackStep, TrajectoryReport, diff_reports, load_report

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reports-0.1.0"
# ESC sequences that clear the screen and set the title, BEL, a bidi override, rich markup, a
# backslash, a C1 control, DEL, a zero-width space, a line separator, and mathtext that cannot parse
HOSTILE = "emb\x1b[2J\x1b]0;title\x07\u202e[bold]x\\y\x9b\x7f\u200b\u2028$a^$"
SHOWN = "emb\\x1b[2J\\x1b]0;title\\x07\\u202e[bold]x\\\\y\\x9b\\x7f\\u200b\\u2028$a^$"
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)


def unescape(text: str) -> str:
    """The inverse of ``printable``: its existence proves that different names print differently."""
    def one(match: re.Match) -> str:
        code = match.group(0)
        return "\\" if code == "\\\\" else chr(int(code[2:], 16))

    return re.sub(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})", one, text)


# ----------------------------------------------------------------------------- the function


@given(ANY_TEXT)
@example("emb\\x1b[2J")  # a name that spells an escape: not read back as ESC
@example("\\\x1b")
def test_any_text_prints_as_visible_characters_and_can_be_read_back(text):
    out = printable(text)
    assert out.isprintable()  # no control, format, separator or unpaired surrogate character left
    assert unescape(out) == text  # so two different texts never print alike


@given(ANY_TEXT, ANY_TEXT)
@example("emb\x1b[2J", "emb\\x1b[2J")  # a control character, and a name that spells its escape
@example("\\\\", "\\")
def test_two_different_names_never_print_alike(a, b):
    assert (printable(a) == printable(b)) == (a == b)


def test_a_printable_name_is_printed_as_it_is_and_a_hostile_one_escaped():
    for name in ("embed.weight", "model.layers.0.self_attn.q_proj.weight", "Ünïcödé 名前 [bold]"):
        assert printable(name) == name
    assert printable(HOSTILE) == SHOWN
    assert printable("\ud800") == "\\ud800" and printable("\U000e0001") == "\\U000e0001"


def test_shown_copies_a_report_once_and_leaves_the_original_alone():
    report = mixed()
    report.tensors[0].name = HOSTILE
    once = shown(report)
    assert once.tensors[0].name == SHOWN and report.tensors[0].name == HOSTILE
    assert shown(once) is once  # drawn by several renderers, escaped once
    assert once.tensors[1].verdict == report.tensors[1].verdict and once.exit_code == report.exit_code


# ----------------------------------------------------------------------------- every renderer


def hostile_report():
    report = load_report(FIXTURES / "torch-double-step.json")
    report.case = HOSTILE
    flagged = report.flagged[0]
    flagged.name = HOSTILE
    flagged.ratio_map, flagged.ratio_map_cell = [[0.0, 2.0], [1.0, 0.5]], [1, 1]
    return report


def hostile_cross():
    cross = load_report(FIXTURES / "cross.json")
    cross.reports[0].tensors[0].name = HOSTILE
    cross.agreement[0].name = HOSTILE
    cross.agreement[0].verdict, cross.agreement[0].ratio = "disagree", 5.0  # named in the summary
    return cross


def hostile_sweep():
    sweep = load_report(FIXTURES / "sweep.json")
    for r in sweep.reports:
        r.tensors[0].name = HOSTILE
        r.tensors[0].verdict = "diverged"
    return sweep


def hostile_stack(name: str = HOSTILE):
    result = FullBatchResult(normalisation="mean", accumulated_scaled_by="1/N", max_relative_difference=0.75,
                             worst_tensor=name, equivalent=False, tolerance=1e-9, factor=0.25, constant=True,
                             matches="1/N", explanation=f"0.250 x the window's gradient: matches 1/N: {name}")
    return StackReport(stack="transformers", model=name, accum_steps=4, steps=[StackStep(0, [0, 1, 2, 3], result)],
                       micro_batches_seen=4, unstepped=[], precision="float64", versions={"torch": "2"},
                       tolerance=1e-9, notes=[name], reproduce=f"accumcheck stack --case {name}")


def hostile_trajectory():
    return TrajectoryReport(case=HOSTILE, optimizer="adam", lr=1e-3, accum_steps=4, steps=2, inject=None, versions={},
                            losses={"native": [0.5, 0.4], "manual": [0.5, 0.4]}, max_diff={HOSTILE: [0.0, 1.0]},
                            band_ratio={HOSTILE: [0.0, 2.0]}, first_out_of_band={HOSTILE: 1})


def hostile_controlled_trajectory():
    """The hostile trajectory with a control: a hostile kind's columns, legend and plot lines."""
    return dataclasses.replace(hostile_trajectory(), control_diff={HOSTILE: [1.0, 1.0]},
                               control_ratio={HOSTILE: [0.0, 1.0]}, margin=100.0)


def hostile_diff():
    a = hostile_report()
    b = copy.deepcopy(a)
    b.tensors[0].verdict = "diverged"
    return diff_reports(a, b, (f"{HOSTILE}.json", "b.json"))


KINDS = {"report": hostile_report, "cross": hostile_cross, "sweep": hostile_sweep, "stack": hostile_stack,
         "trajectory": hostile_trajectory, "diff": hostile_diff}
FORMATS = {"report": ("markdown", "csv", "html"), "cross": ("markdown", "csv", "html"),
           "sweep": ("markdown", "csv", "html"), "stack": ("markdown",), "trajectory": (), "diff": ("markdown",)}


def raw(text: str) -> list[str]:
    """The characters a terminal would act on or hide, a line's end aside."""
    return sorted({repr(ch) for ch in text if not ch.isprintable() and ch != "\n"})


def live(report, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    render_console(report, console)
    return console.file.getvalue()


@pytest.mark.parametrize("kind", KINDS)
def test_no_renderer_prints_a_raw_control_character_of_a_name(kind):
    report = KINDS[kind]()
    drawn = {"table": table_text(report), "terminal": live(report)}
    drawn.update({fmt: render(report, fmt) for fmt in FORMATS[kind]})
    if kind != "trajectory" and kind != "diff":
        drawn["summary"] = one_line(report)
    if kind in ("report", "cross", "stack"):  # what a failing pytest prints (accumcheck.assert_faithful)
        drawn["assertion"] = failure_message(report)
    for fmt, text in drawn.items():
        assert raw(text) == [], (kind, fmt)
        flat = text if fmt != "html" else text.replace("&#x27;", "'").replace("&amp;", "&")
        assert SHOWN.split("[bold]")[0] in flat, (kind, fmt)  # the name is there, escaped
    for fmt in ("table", "terminal"):
        assert "[bold]x" in drawn[fmt]  # rich markup in a name is printed, not obeyed


def test_a_name_with_bars_and_backticks_keeps_the_markdown_table_whole():
    report = mixed()
    report.tensors[0].name = "a|b`c``d"
    lines = markdown(report).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert len({len(re.findall(r"(?<!\\)\|", row)) for row in rows}) == 1  # every row has each column
    assert rows[1].startswith("| ```a\\|b`c``d``` |")  # a code span its backticks cannot end


def test_the_summary_line_and_the_details_escape_a_name():
    report = hostile_report()
    assert raw(summary_line(report)) == [] and SHOWN in summary_line(report)
    lines = tensor_details(report.flagged[0])
    assert lines[0].startswith(SHOWN) and raw("\n".join(lines)) == []


def test_the_pictures_draw_an_escaped_name_and_never_read_it_as_mathtext():
    report = hostile_report()
    texts = [t.get_text() for ax in scatter(report).axes for t in ax.texts + [ax.title]]
    maps = heatmaps(report)
    maps.canvas.draw()  # mathtext would fail here on the name's $a$
    texts += [ax.get_title() for ax in maps.axes] + [maps._suptitle.get_text()]
    texts += [ax.get_title() for ax in growth(hostile_sweep().reports).axes]
    texts += [ax.get_title() for ax in trajectory(hostile_trajectory()).axes]
    controlled = trajectory(hostile_controlled_trajectory())
    controlled.canvas.draw()  # mathtext would fail here on the name's $a$, in a legend too
    texts += [ax.get_title() for ax in controlled.axes]
    texts += [t.get_text() for ax in controlled.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any(SHOWN in t for t in texts)
    assert all(raw(t) == [] for t in texts)


def test_a_case_files_name_and_description_are_escaped_in_the_cases_table():
    from accumcheck.case.reading import builtin_cases

    case = dataclasses.replace(builtin_cases()[0], name=HOSTILE, description=f"about {HOSTILE}")
    console = Console(file=io.StringIO(), width=100, color_system=None, force_terminal=False)
    render_cases([case], console)
    text = console.file.getvalue()
    assert raw(text) == [] and "[bold]x" in text


# ----------------------------------------------------------------------------- fitting the width


LLAMA = [f"model.layers.{i}.{part}.weight" for i in range(12)
         for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "post_attention_layernorm")]


def test_a_shortened_name_keeps_its_start_and_end_and_names_stay_apart():
    ends = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]  # apart at their ends
    assert [cell_len(c) for c in shorten(ends, 20)] == [20] * 4 and len(set(shorten(ends, 20))) == 4
    # apart at two places (the layer, the projection): no cut of 24 cells keeps them apart, so they
    # are cut wider, never alike
    cut = shorten(LLAMA, 24)
    assert len(set(cut)) == len(LLAMA)
    assert 24 < max(map(cell_len, cut)) < max(map(cell_len, LLAMA))
    for name, short in zip(LLAMA, cut):
        assert short == name or (name.startswith(short.split("…")[0]) and name.endswith(short.split("…")[1]))
    assert shorten(["short", "names"], 24) == ["short", "names"]


@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Cf", "Zl", "Zp")),
                        max_size=30), unique=True, max_size=8), st.integers(4, 30))
def test_shortened_names_are_never_alike(names, width):
    cut = shorten(names, width)
    assert len(set(cut)) == len(names)
    assert all(c == n or ("…" in c and cell_len(c) <= cell_len(n)) for c, n in zip(cut, names))


def user_model_report():
    names = LLAMA[:8] + ["model.embed_tokens.weight"]
    verdicts = ["diverged (marginal)", "precision-loss", "round-off (ill-conditioned)"]
    tensors = [tensor(n, verdict="diverged" if i == 0 else "precision-loss" if i == 1 else "round-off",
                      severity="marginal" if i == 0 else None, ill_conditioned=i == 2, ratio=123456.0)
               for i, n in enumerate(names)]
    report = mixed()
    report.tensors = tensors
    return report, names, verdicts


def reports_of_every_kind():
    report, names, verdicts = user_model_report()
    yield "user model", report, names, verdicts
    fixture = load_report(FIXTURES / "torch-double-step.json")
    yield "fault", fixture, [t.name for t in fixture.tensors], ["diverged"]
    cross = load_report(FIXTURES / "cross.json")
    yield "cross", cross, [a.name for a in cross.agreement], sorted({a.verdict for a in cross.agreement})
    parallel = load_report(FIXTURES / "data-parallel.json")
    yield "data parallel", parallel, [t.name for t in parallel.tensors], []
    sweep = load_report(FIXTURES / "sweep.json")
    yield "sweep", sweep, sorted({t.kind for t in sweep.reports[0].tensors}), []
    yield "stack", hostile_stack("padded-tokens"), [], ["constant-factor"]
    traj = dataclasses.replace(hostile_trajectory(), band_ratio={"embedding": [0.0, 2.0], "weight": [1.0, 3.0]})
    yield "trajectory", traj, [], []
    yield "trajectory", dataclasses.replace(hostile_controlled_trajectory(), band_ratio=traj.band_ratio,
                                            max_diff={"embedding": [0.0, 1e-6], "weight": [1e-7, 2e-6]},
                                            control_diff={"embedding": [1e-6, 1e-6], "weight": [1e-7, 1e-6]},
                                            control_ratio={"embedding": [0.0, 1.0], "weight": [1.0, 2.0]}), [], []
    other = copy.deepcopy(fixture)
    other.tensors[0].verdict = "identical"
    diff = diff_reports(fixture, other, ("a.json", "b.json"))
    yield "diff", diff, [c.name for c in diff.common], []


def middle_cut(word: str, name: str) -> bool:
    """Whether ``word`` is ``name`` cut in the middle: a start and an end of it, both kept, around
    one ellipsis (a name cut at its end, as a table overflowing its column does, is not)."""
    if word.count("…") != 1:
        return False
    head, tail = word.split("…")
    return bool(head) and bool(tail) and name.startswith(head) and name.endswith(tail)


@pytest.mark.parametrize("width", (60, 80, 100, 120))
def test_every_table_fits_the_width_and_cuts_no_name_verdict_or_header(width):
    for kind, report, names, verdicts in reports_of_every_kind():
        text = live(report, width)
        lines = text.splitlines()
        summary = one_line(report) if kind not in ("trajectory", "diff") else lines[-1]
        wide = [line for line in lines if cell_len(line) > width and line != summary]
        assert not wide, (kind, wide)  # the summary alone stays whole, however long
        words = set(text.split())
        for name in names:  # whole on a line, or (too long for the width) cut in the middle only: its
            assert name in words or any(middle_cut(w, name) for w in words), (kind, name)  # start and end kept
        rows = [line for line in lines if any(w in names or any(middle_cut(w, n) for n in names)
                                              for w in line.split())]
        for verdict in verdicts:  # whole in a table row beside its name, not only in the details below
            assert any(verdict in row for row in (rows if names else lines)), (kind, verdict)
        for word in (w for w in words if "…" in w):  # nothing else shortened: no verdict, header or number
            assert any(middle_cut(word, n) for n in names), (kind, word)


@pytest.mark.parametrize("width", (80, 120))
def test_a_table_too_wide_for_the_width_goes_on_in_a_second_part_with_the_names_again(width):
    report = load_report(FIXTURES / "torch-double-step.json")
    lines = live(report, width).splitlines()
    heads = [line.split("  ") for line in lines if line.split()[:1] == ["tensor"]]
    headers = {cell.strip() for head in heads for cell in head if cell.strip()}
    assert headers >= {"tensor", "kind", "shape", "max|g|", "verdict", "ratio", "max|A-B|", "ulps", "tol fails",
                       "cond"}
    assert len(heads) == (1 if width == 120 else 2)
    assert any("ratio:" in line for line in lines) and any("cond:" in line for line in lines)  # the legend


def test_a_file_keeps_each_line_whole_and_a_terminal_splits_the_command_between_options():
    report = load_report(FIXTURES / "torch-double-step.json")
    command = f"reproduce: {report.reproduce_command()}"
    assert command in table_text(report, width=80).splitlines()
    lines = live(report, 80).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("reproduce: "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith(" \\"))
    assert end > start and all(line.startswith("    --") for line in lines[start + 1:end + 1])
    assert " ".join(line.rstrip("\\").strip() for line in lines[start:end + 1]).split() == command.split()
