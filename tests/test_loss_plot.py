"""`loss.png` (`eqx_gpt.visualize.loss_figure`): what is drawn, read from the Figure's artists, not
its pixels: the periodic curves, and the final validation's point with a legend entry saying
whether it covers the whole split or is estimated from a sample."""

import pytest

RECORDS = [
    {"step": 1, "loss": 4.2, "lr": 1e-4, "tokens_per_s": 100.0},
    {"step": 0, "train_loss": 4.3, "val_loss": 4.31, "elapsed_s": 0.1},
    {"step": 10, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 10, "train_loss": 2.9, "val_loss": 3.05, "elapsed_s": 1.0},
]


def lines_by_label(records):
    from eqx_gpt.visualize import loss_figure  # here, not at collection: matplotlib takes 1 s to import

    fig = loss_figure(records)
    [ax] = fig.axes
    legend = ax.get_legend()
    assert legend is not None
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    return drawn, [text.get_text() for text in legend.get_texts()], ax


@pytest.mark.parametrize(
    ("whole", "says"),
    [(True, "final validation, whole split (111,540 tokens): 2.9876"),
     (False, "final validation, estimated from 524,288 tokens: 2.9876")],
)  # fmt: skip
def test_the_final_validation_is_a_point_beside_the_curve_saying_which_it_is(whole, says):
    tokens = 111_540 if whole else 524_288
    final = {"step": 10, "final_val_loss": 2.98765, "val_tokens": tokens, "whole_split": whole}
    drawn, legend, ax = lines_by_label([*RECORDS, final])
    assert drawn[says] == ([10], [2.98765])
    assert says in legend
    assert drawn["validation"] == ([0, 10], [4.31, 3.05])  # the periodic curve stays as it was
    assert drawn["train (batch)"] == ([1, 10], [4.2, 3.0])
    low, _ = ax.get_ylim()
    assert low <= 2.98765


def test_without_a_final_record_there_is_no_final_point():
    drawn, legend, _ = lines_by_label(RECORDS)
    assert sorted(drawn) == ["train (batch)", "train (eval)", "validation"]
    assert not [text for text in legend if text.startswith("final")]


def test_the_last_final_record_is_drawn_and_an_old_one_without_whole_split_says_neither():
    from eqx_gpt.visualize import final_label

    old = {"step": 10, "final_val_loss": 3.5}
    assert final_label(old) == "final validation: 3.5000"
    newer = {"step": 10, "final_val_loss": 3.25, "val_tokens": 64, "whole_split": True}
    drawn, _, _ = lines_by_label([*RECORDS, old, newer])
    finals = {label: points for label, points in drawn.items() if label.startswith("final")}
    assert finals == {"final validation, whole split (64 tokens): 3.2500": ([10], [3.25])}


def test_plot_losses_writes_a_png(tmp_path):
    from eqx_gpt.visualize import plot_losses

    path = plot_losses([*RECORDS, {"step": 10, "final_val_loss": 3.0}], tmp_path / "loss.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
