// Live state without reloads: any element with data-live-url is refreshed from that URL (a fragment of
// server-rendered HTML) every data-live-seconds (default 3). Paused while the tab is hidden.
(function () {
  function refresh(element) {
    if (document.hidden) return;
    fetch(element.dataset.liveUrl, { headers: { "X-Requested-With": "fetch" }, credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) { if (html !== null && html !== element.innerHTML) element.innerHTML = html; })
      .catch(function () {});
  }
  function start() {
    document.querySelectorAll("[data-live-url]").forEach(function (element) {
      var seconds = parseFloat(element.dataset.liveSeconds || "3");
      setInterval(function () { refresh(element); }, seconds * 1000);
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
