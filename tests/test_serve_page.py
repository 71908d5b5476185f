"""The page at `/`, driven in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
which .ci/run installs) through selenium: generate, stream, move a slider, see the heatmap labelled
with its tokens and its colour scale, open a head from all the layer's heads, read the logit lens;
follow a run through two new checkpoints; and use the page under an API key.

The README's picture (docs/serve-page.png) is of a trained run: tests/tools/page_screenshot.py."""

import shutil

import jax
import pytest

pytest.importorskip("starlette")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from serve_fixtures import LiveServer, app_for, make_run  # noqa: E402

from eqx_gpt import GPT, load_model, save_checkpoint  # noqa: E402

CHROMEDRIVER = shutil.which("chromedriver")
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMEDRIVER is None or BROWSER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
]
WAIT_S = 60  # every wait below is bounded


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1500"):
        options.add_argument(flag)
    options.binary_location = BROWSER
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def bars(driver, column: str) -> str:
    return driver.find_element(By.ID, column).text


def texts(driver, selector: str) -> list[str]:
    return [e.get_attribute("textContent") for e in driver.find_elements(By.CSS_SELECTOR, selector)]


def canvas_pixels(driver, selector: str) -> str:
    return driver.execute_script(f"return document.querySelector('{selector}').toDataURL();")


def coloured(driver, canvas_id: str) -> int:
    """Pixels of a canvas that are not white: its drawn cells."""
    return driver.execute_script(
        f"const c = document.getElementById('{canvas_id}');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 250) n++; return n;"
    )


def test_the_heatmap_is_labelled_a_head_opens_from_all_heads_and_the_lens_is_filled(browser, tmp_path):
    run = make_run(tmp_path)
    with LiveServer(app_for(run, slots=2)) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#heads figure")) == 4)  # 4 heads
        # Labelled with its tokens on both axes ("ROMEO:", the prompt), and a colour scale.
        wait.until(lambda d: texts(d, "#attention-rows span") == list("ROMEO:"))
        assert texts(browser, "#attention-cols span") == list("ROMEO:")
        ticks = texts(browser, "#scale-ticks span")
        assert ticks[0] == "1" and ticks[-1] == "0"
        assert coloured(browser, "scale-bar") > 1000 and coloured(browser, "attention") > 1000

        # A head opened from the small multiples: the selector and the big heatmap follow.
        big = canvas_pixels(browser, "#attention")
        browser.find_element(By.CSS_SELECTOR, '#heads figure[data-head="3"]').click()
        wait.until(lambda d: d.find_element(By.ID, "head").get_attribute("value") == "3")
        opened = '#heads figure[data-head="3"].selected'
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, opened)) == 1)
        wait.until(lambda d: canvas_pixels(d, "#attention") != big)

        # The lens: one row per layer, the last one the model's own top tokens (the bars).
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#lens tr")) == 2)
        last = browser.find_elements(By.CSS_SELECTOR, "#lens tr")[-1]
        assert "output" in last.text
        assert texts(browser, "#lens tr:last-child td .token")[:3] == texts(browser, "#before .token")[:3]


def test_the_page_follows_a_run_through_two_checkpoints(browser, tmp_path):
    run = make_run(tmp_path)
    served, tokenizer, _ = load_model(run, kind="GPT")
    with LiveServer(app_for(run, slots=2, follow=run, follow_every_s=0.2)) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: d.find_element(By.ID, "run-step").text == "20")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#lens tr")) == 2)
        assert "following the run" in browser.find_element(By.ID, "run-state").text
        for step in (30, 40):
            shown = bars(browser, "before"), texts(browser, "#lens td")
            newer = GPT(served.config, key=jax.random.key(step))
            save_checkpoint(run, "latest", newer, None, step=step, tokenizer=tokenizer, train_config={})
            wait.until(lambda d, step=step: d.find_element(By.ID, "run-step").text == str(step))
            # The same text's predictions and lens, shown anew from the new weights.
            wait.until(lambda d, shown=shown: (bars(d, "before"), texts(d, "#lens td")) != shown)


def test_the_page_asks_for_the_api_key_and_sends_it(browser, tmp_path):
    run = make_run(tmp_path)
    with LiveServer(app_for(run, slots=2, api_key="s3cret-key")) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: d.find_element(By.ID, "key-box").is_displayed())  # a 401 asked for it
        assert browser.find_element(By.ID, "model-name").text == ""
        browser.find_element(By.ID, "api-key").send_keys("s3cret-key")
        browser.find_element(By.ID, "key-use").click()
        wait.until(lambda d: d.find_element(By.ID, "model-name").text == "tiny")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#after .bar-row")) == 10)
        assert not browser.find_element(By.ID, "key-box").is_displayed()
        browser.find_element(By.ID, "generate").click()  # a completion with the key too
        wait.until(lambda d: len(d.find_element(By.ID, "output").text) > len("ROMEO:"))
        wait.until(lambda d: d.find_element(By.ID, "generate").is_enabled())
        assert "[" not in browser.find_element(By.ID, "output").text  # no error appended


def test_the_page_generates_streams_reshapes_the_bars_and_draws_attention(browser, tmp_path):
    (tmp_path / "run").mkdir()
    run = make_run(tmp_path / "run")
    with LiveServer(app_for(run, slots=2)) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: d.find_element(By.ID, "model-name").text == "tiny")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#after .bar-row")) == 10)

        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("KING RICHARD:")
        browser.find_element(By.ID, "seed").send_keys("3")
        browser.find_element(By.ID, "generate").click()
        output = browser.find_element(By.ID, "output")
        # Streamed: the text grows while the button is still disabled, then reaches 200 new tokens.
        wait.until(lambda d: len(output.text) > len("KING RICHARD:"))
        wait.until(lambda d: d.find_element(By.ID, "generate").is_enabled())
        assert output.text.startswith("KING RICHARD:") and len(output.text) >= len("KING RICHARD:") + 150
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens span")) == 32)  # the context

        before = bars(browser, "after")
        slider = browser.find_element(By.ID, "top-k")
        browser.execute_script(
            "arguments[0].value = 3; arguments[0].dispatchEvent(new Event('input'));", slider
        )
        wait.until(lambda d: bars(d, "after") != before)
        shown = [float(v.text) for v in browser.find_elements(By.CSS_SELECTOR, "#after .value")]
        assert sum(v > 0 for v in shown) == 3 and abs(sum(shown) - 1) < 0.01

        assert coloured(browser, "attention") > 1000  # coloured cells, not a blank canvas
        assert texts(browser, "#attention-rows span") == texts(browser, "#tokens span")  # the 32 tokens
        assert browser.find_element(By.ID, "card").text.count("final val loss") == 1

        path = tmp_path / "serve-page.png"
        assert browser.save_screenshot(str(path)) and path.stat().st_size > 10_000


def test_the_page_compares_the_base_and_an_adapter_at_the_cursor(browser, tmp_path):
    """A server holding a LoRA adapter: `#compare` shows the base's and the adapter's next-token bars
    side by side, and they differ (the adapter changes the model)."""
    import equinox as eqx
    import jax

    from eqx_gpt import LoRALinear, apply_lora, create_app, load_model

    (tmp_path / "run").mkdir()
    model, tokenizer, meta = load_model(make_run(tmp_path / "run"), kind="GPT")
    adapter = apply_lora(model, 4, alpha=16.0, key=jax.random.key(1))
    is_lora = lambda n: isinstance(n, LoRALinear)
    lora_b = lambda m: next(n for n in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(n)).lora_b
    adapter = eqx.tree_at(lora_b, adapter, 4.0 * jax.random.normal(jax.random.key(2), lora_b(adapter).shape))
    app = create_app(model, tokenizer, meta=meta, name="tiny", slots=2, adapters={"poet": adapter})
    with LiveServer(app) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-adapter .bar-row")) == 10)
        assert browser.find_element(By.ID, "compare").is_displayed()
        assert "poet" in browser.find_element(By.ID, "compare-adapter-name").text
        assert bars(browser, "compare-base") == bars(browser, "before")  # the base's own bars
        assert bars(browser, "compare-adapter") != bars(browser, "compare-base")
