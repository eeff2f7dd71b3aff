"""lathe serve's chat page (`GET /`) in a real headless Chromium, driven over the DevTools
protocol (websocket-client).

Run by tests/server.rs (test `web_chat_page_in_headless_chromium`) against a server it started
with `--api-key`, with LATHE_URL (the server's base URL), LATHE_API_KEY and LATHE_CHROMIUM (the
browser binary) set. Prints one line per check and `N passed, 0 failed`; exits non-zero on a
failure.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

URL = os.environ["LATHE_URL"].rstrip("/") + "/"
KEY = os.environ["LATHE_API_KEY"]
CHROMIUM = os.environ["LATHE_CHROMIUM"]
passed = 0


def check(name, cond, detail=""):
    global passed
    if not cond:
        print(f"FAIL {name}: {detail}")
        print(f"{passed} passed, 1 failed")
        sys.exit(1)
    passed += 1
    print(f"ok {name}")


def start_browser(profile):
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    p = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    for line in p.stderr:
        if "DevTools listening on ws://" in line:
            ws = line.split("DevTools listening on ", 1)[1].strip()
            return p, ws.split("/")[2]
        if time.time() - t0 > 60:
            break
    p.kill()
    raise SystemExit("FAIL chromium did not start its DevTools endpoint")


class Page:
    def __init__(self, hostport):
        targets = json.load(urllib.request.urlopen(f"http://{hostport}/json/list", timeout=30))
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self.n = 0

    def call(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.n:
                if "error" in m:
                    raise SystemExit(f"FAIL {method}: {m['error']}")
                return m["result"]

    def js(self, expr):
        """The value of a JS expression (awaited when a promise)."""
        r = self.call("Runtime.evaluate", expression=expr, awaitPromise=True,
                      returnByValue=True, timeout=60000)
        if "exceptionDetails" in r:
            raise SystemExit(f"FAIL js {expr[:80]!r}: {json.dumps(r['exceptionDetails'])[:800]}")
        return r["result"].get("value")


# Helpers defined in the page: `until(cond)` polls a condition; `sendMessage(text)` types a
# message and submits it the way a user does.
HELPERS = r"""
window.until = async (cond, ms = 30000) => {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error("timed out waiting for " + cond);
    await new Promise((r) => setTimeout(r, 10));
  }
};
window.setField = (id, v) => {
  const el = document.getElementById(id);
  el.value = v;
  el.dispatchEvent(new Event("change"));
};
window.sendMessage = (text) => {
  document.getElementById("input").value = text;
  document.getElementById("send").click();
};
window.lastReply = () => [...document.querySelectorAll(".msg.assistant")].pop();
window.idle = () => !document.getElementById("send").disabled;
true
"""


def main():
    # chromium's helper processes may still write its profile after the browser is killed
    # and reaped: a failed removal of the temporary profile is not the page's failure
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser, hostport = start_browser(profile)
        try:
            run(Page(hostport))
        finally:
            browser.kill()
            browser.wait()
    print(f"{passed} passed, 0 failed")


def run(page):
    page.call("Page.enable")
    page.call("Page.navigate", url=URL)
    t0 = time.time()
    while page.js("document.readyState") != "complete" or not page.js("!!window.markdown"):
        check("page loads", time.time() - t0 < 30, "not loaded in 30 s")
        time.sleep(0.05)
    check("title", page.js("document.title") == "lathe chat", page.js("document.title"))
    # Embedded and self-contained: nothing fetched from elsewhere.
    others = page.js("performance.getEntriesByType('resource').map(e => e.name)"
                     ".filter(n => !n.startsWith(location.origin))")
    check("no outside resources", others == [], others)
    page.js(HELPERS)

    md = page.js(r"markdown('# Title\n```rust\nfn x() -> u8 { 1 < 2 }\n```\n- **bold** and `code`\n<script>')")
    check("markdown code block", "<pre><code>fn x() -&gt; u8 { 1 &lt; 2 }</code></pre>" in md, md)
    check("markdown inline", "<strong>bold</strong>" in md and "<code>code</code>" in md, md)
    check("markdown heading and list", "<h1>Title</h1>" in md and "<li>" in md, md)
    check("markdown escapes html", "<script>" not in md and "&lt;script&gt;" in md, md)

    # The test model's replies may end at once: its EOS (id 1) is banned through the page's
    # own fetch, so replies run to max_tokens.
    page.js(r"""
      const real = window.fetch;
      window.fetch = (url, opts) => {
        const b = JSON.parse(opts.body);
        b.logit_bias = {"1": -100};
        return real(url, {...opts, body: JSON.stringify(b)});
      };
      true
    """)

    # Without the key the server refuses, and the page says so.
    page.js("setField('key', ''); setField('temperature', '0'); setField('max_tokens', '16'); true")
    page.js("sendMessage('hello'); until(() => idle() && lastReply().querySelector('.error'))")
    err = page.js("lastReply().querySelector('.error').textContent")
    check("no key: the error is shown", "API key" in err, err)

    # With the key: the reply streams in (several updates of the reply as chunks arrive).
    page.js(f"setField('key', {json.dumps(KEY)}); document.getElementById('clear').click(); true")
    page.js(r"""
      window.updates = 0;
      window.watch = new MutationObserver((recs) => { window.updates += recs.length; });
      sendMessage('hello');
      watch.observe(lastReply(), {childList: true, subtree: true, characterData: true});
      until(() => idle())
    """)
    text = page.js("lastReply().querySelector('.content').textContent")
    updates = page.js("window.updates")
    check("reply has text", len(text) > 0, repr(text))
    check("reply streamed", updates >= 3, f"{updates} updates")
    check("no error", page.js("!lastReply().querySelector('.error')"), "")

    # Stop: a long reply stopped after its first tokens; the page ends it and the server
    # frees the slot.
    page.js(r"""
      setField('max_tokens', '100000');
      setField('temperature', '0.8');
      sendMessage('go on');
      until(() => lastReply().querySelector('.content').textContent.length > 0)
    """)
    check("stop enabled while streaming", page.js("!document.getElementById('stop').disabled"))
    page.js("document.getElementById('stop').click(); until(() => idle())")
    check("stopped reply marked", page.js("!!lastReply().querySelector('.stopped')"))
    active = None
    t0 = time.time()
    while time.time() - t0 < 20:
        req = urllib.request.Request(URL + "health")
        active = json.load(urllib.request.urlopen(req, timeout=10))["slots"]["active"]
        if active == 0:
            break
        time.sleep(0.05)
    check("server freed the slot", active == 0, f"active {active}")
    n = len(page.js("lastReply().querySelector('.content').textContent"))
    time.sleep(0.3)
    check("nothing arrives after stop",
          len(page.js("lastReply().querySelector('.content').textContent")) == n)

    # Reasoning is shown apart from the answer (a server stream with reasoning_content).
    page.js(r"""
      window.fetch = async () => {
        const sse = [
          {choices: [{delta: {reasoning_content: "thinking it over"}}]},
          {choices: [{delta: {content: "**yes**, `42`"}}]},
        ].map((c) => "data: " + JSON.stringify(c) + "\n\n").join("") + "data: [DONE]\n\n";
        return new Response(sse, {headers: {"Content-Type": "text/event-stream"}});
      };
      sendMessage('why?');
      until(() => idle())
    """)
    check("reasoning shown", page.js("!lastReply().querySelector('.reasoning').hidden"))
    r = page.js("lastReply().querySelector('.reasoning').textContent")
    c = page.js("lastReply().querySelector('.content').innerHTML")
    check("reasoning apart", "thinking it over" in r and "thinking" not in c, f"{r!r} / {c!r}")
    check("answer rendered", "<strong>yes</strong>" in c and "<code>42</code>" in c, c)


main()
