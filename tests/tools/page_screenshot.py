"""The README's picture of the page (`docs/serve-page.png`), taken of a trained run in Debian's
headless Chromium (as tests/test_serve_page.py drives it):

    uv run train.py --out-dir out/                      # the default model on the bundled text
    uv run python tests/tools/page_screenshot.py out/ docs/serve-page.png

The run is served on a free loopback port; the page writes a Shakespeare prompt, generates 120
tokens at seed 1 (temperature 0.8), points at a token of the answer so that the next-token bars,
the logit lens and the labelled attention show that position, and the window is saved.
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: serve_fixtures
from serve_fixtures import LiveServer  # noqa: E402

from eqx_gpt import create_app, load_model  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (its best checkpoint)")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--layer", type=int, default=2, help="the attention layer shown (default 2)")
    args = parser.parse_args()
    model, tokenizer, meta = load_model(args.run, kind="LanguageModel")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1700"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        with LiveServer(create_app(model, tokenizer, meta=meta, name=args.run.resolve().name)) as live:
            driver.get(live.url + "/")
            wait = WebDriverWait(driver, 120)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#lens tr")) > 0)
            prompt = driver.find_element(By.ID, "prompt")
            prompt.clear()
            prompt.send_keys(PROMPT)
            driver.find_element(By.ID, "seed").send_keys("1")
            driver.execute_script("const s = document.getElementById('max-tokens'); s.value = 120;"
                                  "s.dispatchEvent(new Event('input'));")  # fmt: skip
            layer = driver.find_element(By.ID, "layer")
            driver.execute_script("arguments[0].value = arguments[1];", layer, str(args.layer))
            driver.find_element(By.ID, "generate").click()
            wait.until(lambda d: d.find_element(By.ID, "generate").is_enabled())
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens span")) > 40)
            spans = driver.find_elements(By.CSS_SELECTOR, "#tokens span")
            ActionChains(driver).move_to_element(spans[-12]).perform()
            time.sleep(3)  # the inspection of that position
            driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
