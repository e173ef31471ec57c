// The console's entry point: session check, login form, hash routing to one page module at a time.
// Pages get a root element and return an optional cleanup (e.g. closing the live EventSource).

import * as api from "./api.js";
import {clear, el, field, notice} from "./dom.js";
import * as live from "./live.js";
import * as overview from "./overview.js";
import * as sandboxes from "./sandboxes.js";
import * as approvals from "./approvals.js";
import * as search from "./search.js";
import * as tools from "./tools.js";

const PAGES = {
  live: live.render,
  overview: overview.render,
  sandboxes: sandboxes.render,
  approvals: approvals.render,
  search: search.render,
  hash: tools.renderHash,
  explain: tools.renderExplain,
  replay: tools.renderReplay,
  learn: tools.renderLearn,
};
const DEFAULT_PAGE = "live";

const view = () => document.getElementById("view");
let cleanup = null;

function stopPage() {
  if (typeof cleanup === "function") {
    try { cleanup(); } catch (_) { /* the page is gone anyway */ }
  }
  cleanup = null;
}

function showChrome(loggedIn) {
  document.getElementById("nav").hidden = !loggedIn;
  document.getElementById("who").hidden = !loggedIn;
  document.getElementById("role").textContent = loggedIn ? api.session.role : "";
  document.body.dataset.role = loggedIn ? api.session.role : "";
}

function showLogin(message) {
  stopPage();
  showChrome(false);
  const form = el("form", {class: "login", id: "login-form"},
    el("h1", null, "Sign in"),
    el("p", null, "Paste the operator or auditor token (in the gateway's var directory)."),
    field("Token", "token", {type: "password"}),
    el("button", {type: "submit", id: "login-submit"}, "Sign in"),
    message ? notice("error", message) : null);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = form.querySelector("input[name=token]");
    try {
      await api.login(input.value.trim());
      input.value = "";
      showChrome(true);
      route();
    } catch (err) {
      showLogin(err.status === 401 || err.status === 403 ? `Not signed in: ${err.message}` : err.message);
    }
  });
  clear(view(), form);
  form.querySelector("input").focus();
}

function currentPage() {
  const m = /^#\/([a-z]+)/.exec(location.hash);
  return m && Object.hasOwn(PAGES, m[1]) ? m[1] : DEFAULT_PAGE;
}

function route() {
  if (!api.session.role) return;
  stopPage();
  const page = currentPage();
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.getAttribute("href") === `#/${page}`);
  }
  const root = el("section", {class: "page", id: `page-${page}`, "data-testid": `page-${page}`});
  clear(view(), root);
  cleanup = PAGES[page](root);
}

async function start() {
  document.getElementById("logout").addEventListener("click", async () => {
    await api.logout().catch(() => {});
    showLogin();
  });
  window.addEventListener("hashchange", route);
  try {
    await api.restore();
    showChrome(true);
    route();
  } catch (_) {
    showLogin();
  }
  // from now on a 401 means the session ended (expired, logged out elsewhere): back to the login form
  api.setUnauthorizedHandler(() => showLogin("Your session ended; sign in again."));
}

start();
