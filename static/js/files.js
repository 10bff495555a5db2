// Each row's Delete form asks first (its data-confirm says what goes: a folder, everything in it); the
// form itself posts without JavaScript too.
document.addEventListener("submit", function (event) {
  var form = event.target;
  if (form.classList && form.classList.contains("file-delete") && !window.confirm(form.dataset.confirm)) {
    event.preventDefault();
  }
});

// Resumable uploads for the files page, over the files API (docs/STORAGE.md): begin an upload, then send
// the file in parts at the offset the server holds. The upload's id is kept in localStorage under the
// file's target, size and date, so choosing the same file again after a cut asks the server where it
// stands and sends only the rest.
(function () {
  var box = document.getElementById("upload");
  if (!box) return;
  var chunk = parseInt(box.dataset.chunkBytes, 10);
  var labels = document.getElementById("upload-labels").dataset;

  function csrf() {
    var match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }
  function call(method, url, body, headers) {
    var all = Object.assign({ "X-CSRFToken": csrf() }, headers || {});
    return fetch(url, { method: method, body: body, headers: all, credentials: "same-origin" });
  }
  function json(response) {
    return response.json().then(function (data) {
      if (!response.ok && response.status !== 409) throw new Error(data.error ? data.error.message : response.status);
      return [response.status, data];
    });
  }
  function begin(path, file, key) {
    var known = localStorage.getItem(key);
    var fresh = function () {
      return call("POST", "/api/v1/files/uploads", JSON.stringify({ path: path, size: file.size }),
        { "Content-Type": "application/json" }).then(json).then(function (answer) {
        // 409 here is not an offset to resume from: the most uploads at once are under way
        if (answer[0] === 409) throw new Error(answer[1].error ? answer[1].error.message : 409);
        localStorage.setItem(key, answer[1].id);
        return answer[1];
      });
    };
    if (!known) return fresh();
    return call("GET", "/api/v1/files/uploads/" + known).then(function (response) {
      return response.ok ? response.json() : fresh();
    });
  }
  function send(upload, file, row) {
    var offset = upload.offset;
    function next() {
      row.textContent = file.name + ": " + Math.floor((100 * offset) / (file.size || 1)) + " %";
      if (offset >= file.size) return Promise.resolve();
      var part = file.slice(offset, Math.min(offset + chunk, file.size));
      return call("PATCH", "/api/v1/files/uploads/" + upload.id, part, {
        "Upload-Offset": String(offset), "Content-Type": "application/offset+octet-stream",
      }).then(json).then(function (answer) {
        if (answer[0] !== 409) { offset = answer[1].offset; return next(); }
        // the server holds another offset (a part that arrived, or did not), or a part is still
        // arriving: ask where the upload stands, a moment later, and go on from there
        return new Promise(function (wait) { setTimeout(wait, 1000); })
          .then(function () { return call("GET", "/api/v1/files/uploads/" + upload.id); })
          .then(json).then(function (status) { offset = status[1].offset; return next(); });
      });
    }
    return next();
  }
  function upload(file) {
    var path = (box.dataset.folder ? box.dataset.folder + "/" : "") + file.name;
    var key = "suanli-upload:" + path + ":" + file.size + ":" + file.lastModified;
    var row = document.createElement("li");
    document.getElementById("upload-progress").appendChild(row);
    row.textContent = file.name;
    return begin(path, file, key)
      .then(function (started) {
        if (started.offset > 0) row.textContent = file.name + ": " + labels.resuming;
        return send(started, file, row);
      })
      .then(function () {
        localStorage.removeItem(key);
        row.textContent = file.name + ": " + labels.done;
      })
      .catch(function (error) { row.textContent = file.name + ": " + labels.failed + " (" + error.message + ")"; });
  }
  document.getElementById("upload-start").addEventListener("click", function () {
    var files = Array.prototype.slice.call(document.getElementById("upload-files").files);
    files.reduce(function (done, file) { return done.then(function () { return upload(file); }); }, Promise.resolve())
      .then(function () { window.location.reload(); });
  });
})();
