"""The page at `/`, driven in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
which .ci/run installs) through selenium: generate, stream, move a slider, see the heatmap.

Set SERVE_SCREENSHOT=docs/serve-page.png to keep the screenshot (the README shows that one)."""

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("starlette")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from serve_fixtures import LiveServer, app_for, make_run  # noqa: E402

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

        drawn = browser.execute_script(
            "const c = document.getElementById('attention');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 250) n++; return n;"
        )
        assert drawn > 1000  # coloured cells, not a blank canvas
        assert browser.find_element(By.ID, "card").text.count("final val loss") == 1

        path = Path(os.environ.get("SERVE_SCREENSHOT") or tmp_path / "serve-page.png")
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
