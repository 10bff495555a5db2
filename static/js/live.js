// Live state without reloads: any element with data-live-url is refreshed from that URL (a fragment of
// server-rendered HTML) every data-live-seconds (default 3), or as often as the answer asks. Paused while
// the tab is hidden.
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
        if (answer[0] !== null && answer[0] !== element.innerHTML) element.innerHTML = answer[0];
        again(answer[1]);
      })
      .catch(function () { again(seconds); });
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
