/*
 * Suanli: the portal's notices inside JupyterLab (a stop coming, and "I'm still here" for an idle one).
 *
 * A prebuilt ("federated") JupyterLab 4 extension written by hand, with no build: JupyterLab loads this
 * script (package.json's jupyterlab._build.load), then calls window._JUPYTERLAB[name].init(shareScope)
 * and .get("./extension"), and registers the plugins of the module the factory returns
 * (jupyterlab/staging/bootstrap.js and index.js). It shares no modules: the DOM and fetch only.
 *
 * The page is the lab of session <id> at /jupyter/<id>/ on the portal's own origin. Every poll asks the
 * portal for the session's notices with the browser's portal session; every string shown comes from the
 * portal, in the user's language. A lab opened without the portal (401, 403, 404) stays quiet.
 */
(function () {
  "use strict";

  var NAME = "suanli-notices";
  var QUIET = [401, 403, 404];
  var DEFAULT_POLL_SECONDS = 20;

  function pageConfig() {
    var element = document.getElementById("jupyter-config-data");
    try {
      return JSON.parse((element && element.textContent) || "{}");
    } catch (error) {
      return {};
    }
  }

  /* "/jupyter/<id>/" → the session's API under the portal's prefix, or null on another page. */
  function sessionApi(baseUrl) {
    var match = /^(.*)\/jupyter\/([^/]+)\/$/.exec(baseUrl || "");
    return match ? match[1] + "/api/v1/sessions/" + encodeURIComponent(match[2]) : null;
  }

  function cookie(name) {
    var found = document.cookie.split("; ").filter(function (part) {
      return part.indexOf(name + "=") === 0;
    })[0];
    return found ? decodeURIComponent(found.slice(name.length + 1)) : "";
  }

  function timeLeft(seconds) {
    var s = Math.max(0, Math.floor(seconds));
    var h = Math.floor(s / 3600);
    var m = Math.floor((s % 3600) / 60);
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    return (h ? h + ":" + pad(m) : String(m)) + ":" + pad(s % 60);
  }

  /* The lab's shell moves down by the banner's height, so the banner hides none of the lab. */
  function makeRoom(shell, pixels) {
    if (shell) {
      shell.style.top = pixels ? pixels + "px" : "";
      window.dispatchEvent(new Event("resize"));  // the shell lays itself out again
    }
  }

  function Notices(api, shell) {
    this.api = api;
    this.shell = shell;
    this.banner = null;
    this.ticker = null;
    this.timer = null;
    this.stopped = false;
  }

  Notices.prototype.poll = function () {
    var self = this;
    fetch(this.api + "/notices", { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) { return self.answer(response); })
      .catch(function () { self.next(DEFAULT_POLL_SECONDS); });
  };

  Notices.prototype.answer = function (response) {
    var self = this;
    if (QUIET.indexOf(response.status) !== -1) {
      this.stopped = true;  // not the portal's lab, or not this user's: nothing to say, ever
      this.show(null);
      return null;
    }
    if (!response.ok) {
      this.next(DEFAULT_POLL_SECONDS);
      return null;
    }
    return response.json().then(function (body) {
      self.show(body);
      self.next(body.poll_seconds || DEFAULT_POLL_SECONDS);
    });
  };

  Notices.prototype.next = function (seconds) {
    var self = this;
    clearTimeout(this.timer);
    if (!this.stopped) {
      this.timer = setTimeout(function () { self.poll(); }, seconds * 1000);
    }
  };

  Notices.prototype.stillHere = function (button) {
    var self = this;
    button.disabled = true;
    fetch(this.api + "/still-here", {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
      body: "{}",
    })
      .then(function (response) {
        if (!response.ok) {
          button.disabled = false;
          return null;
        }
        return response.json().then(function (body) { self.show(body); });
      })
      .catch(function () { button.disabled = false; });
  };

  Notices.prototype.show = function (body) {
    var warnings = (body && body.warnings) || [];
    clearInterval(this.ticker);
    if (this.banner) {
      this.banner.remove();
      this.banner = null;
    }
    if (!warnings.length) {
      makeRoom(this.shell, 0);
      return;
    }
    var self = this;
    var labels = body.labels || {};
    var shownAt = Date.now();
    var banner = document.createElement("div");
    banner.id = "suanli-notices";
    banner.setAttribute("role", "alert");
    banner.style.cssText =
      "position:fixed;top:0;left:0;right:0;z-index:100000;display:flex;flex-direction:column;gap:2px;" +
      "font:13px/1.4 system-ui,sans-serif;color:#3b2300;background:#ffe8a3;border-bottom:1px solid #d9a400;" +
      "padding:4px 12px;box-shadow:0 1px 4px rgba(0,0,0,.2)";
    var clocks = warnings.map(function (warning) {
      var row = document.createElement("div");
      row.className = "suanli-notice";
      row.setAttribute("data-kind", warning.kind);
      row.style.cssText = "display:flex;align-items:center;gap:12px;flex-wrap:wrap";
      var text = document.createElement("span");
      text.textContent = warning.message;
      var clock = document.createElement("strong");
      clock.className = "suanli-notice-left";
      row.appendChild(text);
      row.appendChild(clock);
      if (warning.still_here && labels.still_here) {
        var button = document.createElement("button");
        button.type = "button";
        button.textContent = labels.still_here;
        button.style.cssText = "font:inherit;padding:2px 10px;cursor:pointer";
        button.addEventListener("click", function () { self.stillHere(button); });
        row.appendChild(button);
      }
      banner.appendChild(row);
      return { element: clock, seconds: warning.seconds_left };
    });
    var tick = function () {
      var elapsed = (Date.now() - shownAt) / 1000;
      clocks.forEach(function (clock) {
        var left = timeLeft(clock.seconds - elapsed);
        clock.element.textContent = (labels.stops_in || "{time}").replace("{time}", left);
      });
    };
    tick();
    this.ticker = setInterval(tick, 1000);
    document.body.appendChild(banner);
    this.banner = banner;
    makeRoom(this.shell, banner.offsetHeight);
  };

  var plugin = {
    id: NAME + ":plugin",
    description: "Shows the portal's stop warnings for this session, with \"I'm still here\".",
    autoStart: true,
    activate: function (app) {
      var api = sessionApi(pageConfig().baseUrl);
      if (api) {
        new Notices(api, app && app.shell && app.shell.node).poll();
      }
    },
  };
  var extension = { __esModule: true, default: [plugin] };

  window._JUPYTERLAB = window._JUPYTERLAB || {};
  window._JUPYTERLAB[NAME] = {
    init: function () {},  // no shared modules to take or give
    get: function (module) {
      if (module !== "./extension") {
        return Promise.reject(new Error(NAME + " has no module " + module));
      }
      return Promise.resolve(function () { return extension; });
    },
  };
})();
