/* Search for the manual opened from its files (file:// URLs), with no server and no network.
 *
 * Browsers refuse to start a Web Worker from a file:// page, and the theme's search runs in one. On such a page
 * this script replaces `Worker` with a stand-in that runs the worker's script in a hidden iframe of the same page:
 * messages go in as "message" events of the iframe's window, the script's `postMessage` calls come back as
 * "message" events of the stand-in, and `importScripts` loads scripts in order and returns a promise (the theme's
 * search worker waits for it). The search index itself is read from search/search_index.js, which Material's
 * offline plugin writes. Served over HTTP(S) the browser's own Worker is used and this script does nothing.
 * (The name keeps the offline plugin from adding a copy of its usual shim from the network.)
 */
(function () {
  "use strict";
  if (location.protocol !== "file:" || typeof window === "undefined") return;

  function loadScript(doc, src) {
    return new Promise(function (resolve, reject) {
      var script = doc.createElement("script");
      script.src = src;
      script.onload = function () { resolve(); };
      script.onerror = function () { reject(new Error("cannot load " + src)); };
      (doc.head || doc.documentElement).appendChild(script);
    });
  }

  function FileWorker(url) {
    var self = this;
    var target = document.createElement("div");       // an EventTarget the page listens on
    var queue = [];
    var ready = false;
    var base = new URL(String(url), location.href).href;
    this.onmessage = null;
    this.onerror = null;
    this.addEventListener = target.addEventListener.bind(target);
    this.removeEventListener = target.removeEventListener.bind(target);
    this.dispatchEvent = target.dispatchEvent.bind(target);

    var frame = document.createElement("iframe");
    frame.setAttribute("aria-hidden", "true");
    frame.setAttribute("tabindex", "-1");
    frame.style.display = "none";
    (document.body || document.documentElement).appendChild(frame);
    var win = frame.contentWindow;
    var doc = frame.contentDocument;

    win.postMessage = function (data) {                 // the worker's replies
      var event = new MessageEvent("message", { data: data });
      setTimeout(function () {
        if (typeof self.onmessage === "function") self.onmessage(event);
        target.dispatchEvent(event);
      }, 0);
    };
    win.importScripts = function () {
      var urls = Array.prototype.slice.call(arguments);
      return urls.reduce(function (chain, src) {
        return chain.then(function () { return loadScript(doc, new URL(src, base).href); });
      }, Promise.resolve());
    };
    win.close = function () { self.terminate(); };

    this._deliver = function (data) {
      win.dispatchEvent(new win.MessageEvent("message", { data: data }));
    };
    this.postMessage = function (data) {
      var copy = typeof structuredClone === "function" ? structuredClone(data) : data;
      if (ready) self._deliver(copy); else queue.push(copy);
    };
    this.terminate = function () {
      queue = [];
      if (frame.parentNode) frame.parentNode.removeChild(frame);
    };

    loadScript(doc, base).then(function () {
      ready = true;
      queue.splice(0).forEach(function (data) { self._deliver(data); });
    }, function (error) {
      var event = new ErrorEvent("error", { message: String(error) });
      if (typeof self.onerror === "function") self.onerror(event);
      target.dispatchEvent(event);
    });
  }

  window.IFrameWorker = FileWorker;   // the theme's search worker looks for this name to find its scripts
  window.Worker = FileWorker;
})();
