// Live state without reloads: any element with data-live-url is refreshed from that URL (a fragment of
// server-rendered HTML) every data-live-seconds (default 3), or as often as the answer asks. Paused while
// the tab is hidden. One answer may carry several parts of a page (data-live-parts): one request a poll.
(function () {
  // The answer's X-Live-Seconds, when it has one, sets the next wait: a session that is starting asks
  // for quick polls so "Open JupyterLab" shows as soon as it can be used, then slower ones.
  function refresh(element, seconds) {
    function again(next) { setTimeout(function () { refresh(element, next); }, next * 1000); }
    if (document.hidden) { again(seconds); return; }
    fetch(element.dataset.liveUrl, { headers: { "X-Requested-With": "fetch" }, credentials: "same-origin" })
      .then(function (response) {
        var next = parseFloat(response.headers.get("X-Live-Seconds")) || seconds;
        return response.ok ? response.text().then(function (html) { return [html, next]; }) : [null, next];
      })
      .then(function (answer) {
        if (answer[0] !== null) place(element, answer[0]);
        again(answer[1]);
      })
      .catch(function () { again(seconds); });
  }
  // An element with data-live-parts gets several parts in one answer (<template data-live-part="name">):
  // each replaces the page's element with the same data-live-part. Otherwise the answer is the element's.
  function place(element, html) {
    if (!("liveParts" in element.dataset)) {
      if (html !== element.innerHTML) element.innerHTML = html;
      return;
    }
    var holder = document.createElement("div");
    holder.innerHTML = html;
    holder.querySelectorAll("template[data-live-part]").forEach(function (part) {
      var target = document.querySelector("[data-live-part='" + part.dataset.livePart + "']:not(template)");
      if (target && target.innerHTML !== part.innerHTML) target.innerHTML = part.innerHTML;
    });
  }
  function start() {
    document.querySelectorAll("[data-live-url]").forEach(function (element) {
      var seconds = parseFloat(element.dataset.liveSeconds || "3");
      setTimeout(function () { refresh(element, seconds); }, seconds * 1000);
    });
    document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
      select.addEventListener("change", function () { select.form.submit(); });
    });
    // A form submits once: a second click on Launch or Stop does nothing while the first is on its way.
    document.querySelectorAll("form[data-once]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (form.dataset.sent) { event.preventDefault(); return; }
        form.dataset.sent = "1";
        form.querySelectorAll("button[type=submit]").forEach(function (b) { b.disabled = true; });
      });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
