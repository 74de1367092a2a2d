// Appended to a copy of the report by tests/test_report_browser.py. Once React has rendered
// the landing page, it measures what the browser laid out (boxes in CSS pixels, relative to
// the viewport at scroll position 0) and prints it into the DOM as JSON.
(function () {
  function box(el) {
    const r = el.getBoundingClientRect();
    return { left: r.left, right: r.right, top: r.top, bottom: r.bottom };
  }
  // The elements from el up whose content is wider than their box: cut, or scrolled sideways.
  function clippedBy(el) {
    const out = [];
    for (let n = el; n && n !== document.documentElement; n = n.parentElement) {
      if (n.scrollWidth > n.clientWidth + 1 && getComputedStyle(n).overflowX !== "visible") {
        out.push((n.tagName + "." + n.className).slice(0, 80));
      }
    }
    return out;
  }
  const timer = setInterval(function () {
    const stats = document.getElementById("tokenmill-stats");
    if (!stats) return;
    clearInterval(timer);
    const tables = Array.from(stats.querySelectorAll("table")).map(function (t) {
      let h = t.previousElementSibling;
      while (h && !/^H\d$/.test(h.tagName)) h = h.previousElementSibling;
      return {
        heading: h ? h.textContent : "",
        box: box(t),
        clipped_by: clippedBy(t),
        rows: Array.from(t.querySelectorAll("tbody tr")).map((tr) =>
          Array.from(tr.cells).map((td) => td.textContent)
        ),
      };
    });
    const description = stats.closest(".prose") || stats.parentElement;
    const pre = document.createElement("pre");
    pre.id = "tokenmill-measure";
    pre.textContent = JSON.stringify({
      viewport: { width: innerWidth, height: innerHeight },
      page_top: box(description.firstElementChild),
      texts: Array.from(description.querySelectorAll("p")).map(box),
      tables: tables,
    });
    document.body.appendChild(pre);
  }, 100);
})();
