// Talking to /ui/api: JSON in, JSON (data, never HTML) out. The session cookie is HttpOnly, so the
// page never sees it; the CSRF token from login/session goes in X-CSRF-Token on every POST/DELETE
// (the browser adds Origin itself on those requests; the server checks both).

export const session = {role: null, csrf: null};

export class ApiError extends Error {
  constructor(status, error, message) {
    super(message || error || `HTTP ${status}`);
    this.status = status;
    this.error = error;
  }
}

async function call(method, path, body, {raw = false} = {}) {
  const headers = {"Accept": "application/json"};
  const init = {method, headers, credentials: "same-origin", cache: "no-store", redirect: "error"};
  if (method !== "GET") {
    if (session.csrf) headers["X-CSRF-Token"] = session.csrf;
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
  }
  const res = await fetch(`/ui/api/${path}`, init);
  if (!res.ok) {
    let error = null;
    let message = null;
    try {
      const data = await res.json();
      error = typeof data.error === "string" ? data.error : null;
      message = typeof data.message === "string" ? data.message : null;
    } catch (_) { /* not JSON: the status says it */ }
    if (res.status === 401 && path !== "login") onUnauthorized();
    throw new ApiError(res.status, error, message || `${res.status} ${res.statusText}`);
  }
  if (raw) return res;
  if (res.status === 204) return null;
  return res.json();
}

let unauthorizedHandler = () => {};
function onUnauthorized() { unauthorizedHandler(); }
export function setUnauthorizedHandler(fn) { unauthorizedHandler = fn; }

export const get = (path) => call("GET", path);
export const post = (path, body) => call("POST", path, body === undefined ? {} : body);
export const del = (path) => call("DELETE", path);
export const postRaw = (path, body) => call("POST", path, body, {raw: true});

/** A query string from an object, leaving out empty values. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? `?${s}` : "";
}

export async function login(token) {
  const data = await call("POST", "login", {token});
  session.role = data.role;
  session.csrf = data.csrf;
  return data;
}

export async function restore() {
  const data = await get("session");
  session.role = data.role;
  session.csrf = data.csrf;
  return data;
}

export async function logout() {
  try { await post("logout"); } finally { session.role = null; session.csrf = null; }
}

export const isOperator = () => session.role === "operator";

/** An id for a path segment: encoded, so a recorded id can never change the route it is sent to
 * ("." and ".." are dot-segments even when percent-encoded: refused). */
export function seg(id) {
  const s = String(id);
  if (s === "" || /^(\.|%2e){1,2}$/i.test(s)) throw new ApiError(0, "invalid_id", "not a valid id");
  return encodeURIComponent(s);
}
