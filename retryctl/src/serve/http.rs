//! The console's routes: pages, the JSON API behind them, logging in, and the checks every
//! request goes through.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use retry_core::{ParkedFilter, ParkedReason};
use serde_json::{Value, json};

use super::auth::{self, COOKIE, SessionId, Viewer, cookies};
use super::html::{self, ListView};
use super::index::{Entry, Group, Key, Sort};
use super::jobs::{self, Action, Job};
use super::selection::{LIFETIME, Selection};
use retry_core::Depth;

use super::{App, Queue};
use crate::present::{parse_when, properties_json, record_json_of, time_text};
use crate::render::header_json;

/// Every response's Content-Security-Policy: no script at all, styles and images from the
/// console only, forms posted to it only, no framing. (The other headers: no sniffing,
/// nothing cached, and a referrer for the console's own pages only: with none at all,
/// chromium sends `Origin: null` with a form, which the origin check must refuse.)
const CSP: &str = "default-src 'none'; script-src 'none'; style-src 'self'; img-src 'self'; \
                   form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Messages a list page shows unless `per_page` says otherwise, and the most it may say.
const PER_PAGE: usize = 50;
const MAX_PER_PAGE: usize = 1000;

/// How a request was let in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    Bearer,
    /// By the cookie of this live session.
    Cookie(SessionId),
}

/// The console's routes.
pub fn router(app: Arc<App>) -> Router {
    let checked = Router::new()
        .route("/", get(overview))
        .route("/q/{queue}", get(queue_page))
        .route("/q/{queue}/groups/{key}", get(group_page))
        .route("/q/{queue}/messages", get(list_page))
        .route("/q/{queue}/message", get(message_page))
        .route("/q/{queue}/{verb}", post(form_post))
        .route("/jobs/{id}", get(job_page))
        .route("/jobs/{id}/cancel", post(form_cancel))
        .route("/api/queues", get(api_queues))
        .route("/api/queues/{queue}", get(api_queue))
        .route("/api/queues/{queue}/groups", get(api_groups))
        .route("/api/queues/{queue}/messages", get(api_messages))
        .route("/api/queues/{queue}/message", get(api_message))
        .route("/api/queues/{queue}/{verb}", post(api_post))
        .route("/api/jobs/{id}", get(api_job))
        .route("/api/jobs/{id}/cancel", post(api_cancel))
        .route("/logout", post(logout))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&app), authorize));
    Router::new()
        .route("/login", get(login_get).post(login_post))
        .route("/static/console.css", get(css))
        .merge(checked)
        .fallback(not_found)
        .layer(middleware::from_fn(secure_headers))
        .with_state(app)
}

async fn secure_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    // Set on every answer, the refusals and the stylesheet included.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn is_api(request: &Request) -> bool {
    request.uri().path().starts_with("/api/")
}

/// Lets in a request with the bearer token or the cookie of a live session; refuses a POST
/// whose `Origin` is another site's. A page asked for without either is sent to `/login`.
/// The request let in is answered with its [`Viewer`] set, so that its page header may
/// show the broker and the logout form.
async fn authorize(State(app): State<Arc<App>>, mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let via = if let Some(token) = bearer {
        if !app.auth.is_token(token.trim()) {
            return refuse(
                &request,
                StatusCode::UNAUTHORIZED,
                "the bearer token is not the console's token",
            );
        }
        Via::Bearer
    } else if let Some(session) = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| cookies(v, COOKIE))
        .find_map(|value| app.auth.session(value, Instant::now()))
    {
        Via::Cookie(session)
    } else {
        if !is_api(&request) && request.method() == Method::GET {
            return redirect("/login");
        }
        return refuse(
            &request,
            StatusCode::UNAUTHORIZED,
            "log in: send Authorization: Bearer TOKEN, or the session cookie /login sets",
        );
    };
    if request.method() == Method::POST && !same_origin(request.headers()) {
        return refuse(
            &request,
            StatusCode::FORBIDDEN,
            "a request from another site's page is refused",
        );
    }
    request.extensions_mut().insert(via);
    let viewer = Viewer {
        csrf: match via {
            Via::Cookie(session) => Some(app.auth.csrf(&session)),
            Via::Bearer => None,
        },
    };
    auth::VIEWER.scope(viewer, next.run(request)).await
}

/// Whether a POST came from a page of the console: its `Origin` (when the browser sends
/// one) names the host it was sent to, and `Sec-Fetch-Site` (when sent) is not cross-site.
fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if text("sec-fetch-site").is_some_and(|s| s == "cross-site" || s == "same-site") {
        return false;
    }
    match (text("origin"), text("host")) {
        (None, _) => true,
        (Some(origin), Some(host)) => {
            origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                == Some(host)
        }
        (Some(_), None) => false,
    }
}

fn refuse(request: &Request, status: StatusCode, why: &str) -> Response {
    if is_api(request) {
        let mut response = (status, json_body(&json!({ "error": why }))).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    } else {
        (status, html_headers(), format!("<!doctype html><title>refused</title><p>{}</p><p><a href=\"/login\">Log in</a></p>", why_html(why))).into_response()
    }
}

fn why_html(text: &str) -> String {
    let mut out = String::new();
    html::escape_into(&mut out, text);
    out
}

fn redirect(to: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(location) = HeaderValue::from_str(to) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

fn html_headers() -> [(header::HeaderName, &'static str); 1] {
    [(header::CONTENT_TYPE, "text/html; charset=utf-8")]
}

fn page(body: String) -> Response {
    (html_headers(), body).into_response()
}

fn json_body(value: &Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(value).unwrap_or_default(),
    )
        .into_response()
}

fn api_error(status: StatusCode, why: impl Into<String>) -> Response {
    with_status(json_body(&json!({ "error": why.into() })), status)
}

async fn css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("console.css"),
    )
        .into_response()
}

async fn not_found(State(app): State<Arc<App>>, request: Request) -> Response {
    if is_api(&request) {
        return api_error(StatusCode::NOT_FOUND, "no such API route");
    }
    page_error(
        &app,
        StatusCode::NOT_FOUND,
        "Not found",
        "There is no such page.",
    )
}

/// Name and value pairs of a query string or a form body, in order.
pub(super) fn fields(text: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(text)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn query_fields(query: &Option<String>) -> Vec<(String, String)> {
    fields(query.as_deref().unwrap_or("").as_bytes())
}

fn value<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

/// The filter that `fields` describe, the message keys they name (`key`, as a message's
/// page gives it), and the words for both; with `require`, a selection that names nothing
/// (and not `all`) is refused.
pub(super) fn selection(
    fields: &[(String, String)],
    require: bool,
) -> Result<(ParkedFilter, Vec<Key>, String), String> {
    let mut words = Vec::new();
    let mut keys = Vec::new();
    for (_, text) in fields.iter().filter(|(k, v)| k == "key" && !v.is_empty()) {
        keys.push(
            Key::parse(text).ok_or_else(|| {
                format!("key {text:?}: 32 hex digits, as a message's page gives it")
            })?,
        );
    }
    match keys.len() {
        0 => {}
        1 => words.push("one message".to_owned()),
        n => words.push(format!("{n} chosen messages")),
    }
    let ids: Vec<String> = fields
        .iter()
        .filter(|(k, v)| (k == "ids" || k == "id") && !v.is_empty())
        .map(|(_, v)| v.clone())
        .collect();
    let mut filter = if ids.is_empty() {
        ParkedFilter::all()
    } else {
        words.push(match ids.as_slice() {
            [one] => format!("id {one}"),
            many => format!("{} ids", many.len()),
        });
        ParkedFilter::ids(ids)
    };
    if let Some(reason) = value(fields, "reason") {
        let reason: ParkedReason = reason.parse().map_err(|e| format!("reason: {e}"))?;
        words.push(format!("reason {reason}"));
        filter = filter.with_reason(reason);
    }
    if let Some((_, group)) = fields.iter().find(|(k, _)| k == "group") {
        words.push(if group.is_empty() {
            "no error recorded".into()
        } else {
            format!("error like “{group}”")
        });
        filter = filter.with_error_group(group.clone());
    }
    if let Some(text) = value(fields, "error") {
        words.push(format!("error containing “{text}”"));
        filter = filter.with_error_containing(text);
    }
    if let Some(after) = value(fields, "after") {
        let t = parse_when(after).map_err(|e| format!("parked after {after:?}: {e}"))?;
        words.push(format!("parked at or after {}", time_text(t)));
        filter = filter.parked_after(t);
    }
    if let Some(before) = value(fields, "before") {
        let t = parse_when(before).map_err(|e| format!("parked before {before:?}: {e}"))?;
        words.push(format!("parked before {}", time_text(t)));
        filter = filter.parked_before(t);
    }
    if value(fields, "all").is_some() {
        if !filter.is_all() || !keys.is_empty() {
            return Err("all cannot be given with another condition".into());
        }
        return Ok((filter, keys, "every message".into()));
    }
    if require && filter.is_all() && keys.is_empty() {
        return Err(
            "nothing selected: give ids, keys, a group, a reason, an error text, a time, or all"
                .into(),
        );
    }
    let text = if words.is_empty() {
        "every message".into()
    } else {
        words.join(", ")
    };
    Ok((filter, keys, text))
}

/// The order, direction, page and page size of a list's query.
pub(super) fn list_options(
    fields: &[(String, String)],
) -> Result<(Sort, bool, usize, usize), String> {
    let sort = match value(fields, "sort") {
        Some(name) => Sort::parse(name).ok_or_else(|| {
            let names: Vec<&str> = Sort::ALL.iter().map(|(_, n)| *n).collect();
            format!("sort {name:?}: use one of {}", names.join(", "))
        })?,
        None => Sort::Position,
    };
    let descending = match value(fields, "dir") {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(other) => return Err(format!("dir {other:?}: use asc or desc")),
    };
    let number = |name: &str, default: usize| -> Result<usize, String> {
        value(fields, name).map_or(Ok(default), |v| {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| format!("{name} {v:?}: a whole number from 1"))
        })
    };
    let page = number("page", 1)? - 1;
    let per_page = number("per_page", PER_PAGE)?;
    if per_page > MAX_PER_PAGE {
        return Err(format!("per_page {per_page}: at most {MAX_PER_PAGE}"));
    }
    Ok((sort, descending, page, per_page))
}

fn csrf_of(app: &App, via: Option<&Via>) -> String {
    match via {
        Some(Via::Cookie(session)) => app.auth.csrf(session),
        _ => String::new(),
    }
}

/// The refusal of a POST let in by the cookie that carries no CSRF token of the session;
/// `None` lets it through.
fn check_csrf(
    app: &App,
    via: Via,
    headers: &HeaderMap,
    fields: &[(String, String)],
) -> Option<Response> {
    let Via::Cookie(session) = via else {
        return None;
    };
    let given = headers
        .get("x-csrf-token")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            fields
                .iter()
                .find(|(k, _)| k == "csrf")
                .map(|(_, v)| v.as_str())
        });
    match given {
        Some(token) if app.auth.is_csrf(&session, token) => None,
        _ => Some((
            StatusCode::FORBIDDEN,
            html_headers(),
            "<!doctype html><title>refused</title><p>This form is out of date or did not come from the console (no valid CSRF token): reload the page and try again.</p>",
        )
            .into_response()),
    }
}

fn queue_of(app: &App, name: &str) -> Result<Arc<Queue>, String> {
    app.queue(name)
        .cloned()
        .ok_or_else(|| format!("the console does not show work queue {name:?}"))
}

fn page_error(app: &App, status: StatusCode, title: &str, text: &str) -> Response {
    with_status(page(html::error_page(app, title, text)), status)
}

// ---- pages ----

async fn overview(State(app): State<Arc<App>>, via: Option<axum::Extension<Via>>) -> Response {
    page(html::overview(&app, &csrf_of(&app, via.as_deref())))
}

async fn queue_page(
    State(app): State<Arc<App>>,
    via: Option<axum::Extension<Via>>,
    Path(name): Path<String>,
) -> Response {
    match queue_of(&app, &name) {
        Ok(queue) => page(html::queue_page(
            &app,
            &queue,
            &csrf_of(&app, via.as_deref()),
        )),
        Err(e) => page_error(&app, StatusCode::NOT_FOUND, "No such queue", &e),
    }
}

async fn group_page(
    State(app): State<Arc<App>>,
    via: Option<axum::Extension<Via>>,
    Path((name, key)): Path<(String, String)>,
) -> Response {
    let queue = match queue_of(&app, &name) {
        Ok(q) => q,
        Err(e) => return page_error(&app, StatusCode::NOT_FOUND, "No such queue", &e),
    };
    let snap = queue.snapshot();
    match snap.index.group(&key) {
        Some(group) => page(html::group_page(
            &app,
            &queue,
            group,
            &csrf_of(&app, via.as_deref()),
        )),
        None => page_error(
            &app,
            StatusCode::NOT_FOUND,
            "No such group",
            "No failure group has this key as of the index: it may have been replayed or purged.",
        ),
    }
}

async fn list_page(
    State(app): State<Arc<App>>,
    via: Option<axum::Extension<Via>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let queue = match queue_of(&app, &name) {
        Ok(q) => q,
        Err(e) => return page_error(&app, StatusCode::NOT_FOUND, "No such queue", &e),
    };
    let fields = query_fields(&query);
    let parsed = selection(&fields, false).and_then(|(f, _, _)| Ok((f, list_options(&fields)?)));
    match parsed {
        Ok((filter, (sort, descending, page_no, per_page))) => page(html::list_page(
            &app,
            &queue,
            &ListView {
                fields: &fields,
                filter: &filter,
                sort,
                descending,
                page: page_no,
                per_page,
            },
            &csrf_of(&app, via.as_deref()),
        )),
        Err(e) => page_error(&app, StatusCode::BAD_REQUEST, "Bad filter", &e),
    }
}

/// The entries a message page or API call asks for, by `id` or `pos`.
fn wanted<'a>(
    snap: &'a super::Snapshot,
    fields: &[(String, String)],
) -> Result<Vec<&'a Entry>, (StatusCode, String)> {
    let id = value(fields, "id");
    let pos = match value(fields, "pos") {
        Some(p) => Some(p.parse::<u64>().map_err(|_| {
            (
                StatusCode::BAD_REQUEST,
                format!("pos {p:?}: a whole number"),
            )
        })?),
        None => None,
    };
    let key = match value(fields, "key") {
        Some(k) => Some(Key::parse(k).ok_or_else(|| {
            (
                StatusCode::BAD_REQUEST,
                format!("key {k:?}: 32 hex digits, as a message's page gives it"),
            )
        })?),
        None => None,
    };
    if id.is_none() && pos.is_none() && key.is_none() {
        return Err((
            StatusCode::BAD_REQUEST,
            "give the message's id, its pos or its key".into(),
        ));
    }
    let found = snap.index.find(id, pos, key);
    if found.is_empty() {
        let mut why = "no parked message with this id, position or key as of the index".to_owned();
        if snap.index.not_kept > 0 {
            why.push_str(&format!(
                " ({} messages did not fit the index: it may be one of them)",
                snap.index.not_kept
            ));
        }
        return Err((StatusCode::NOT_FOUND, why));
    }
    Ok(found)
}

async fn message_page(
    State(app): State<Arc<App>>,
    via: Option<axum::Extension<Via>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let queue = match queue_of(&app, &name) {
        Ok(q) => q,
        Err(e) => return page_error(&app, StatusCode::NOT_FOUND, "No such queue", &e),
    };
    let snap = queue.snapshot();
    match wanted(&snap, &query_fields(&query)) {
        Ok(entries) => page(html::message_page(
            &app,
            &queue,
            &entries,
            &csrf_of(&app, via.as_deref()),
        )),
        Err((status, why)) => page_error(&app, status, "No such message", &why),
    }
}

/// What a POST of an action's form or API call asks for.
struct ActionRequest {
    queue: Arc<Queue>,
    action: Action,
    /// The messages it takes.
    selection: Arc<Selection>,
    /// Whether the request named a selection made before (a confirmation's), rather than
    /// describing one, made now from the index.
    named: bool,
    fields: Vec<(String, String)>,
}

/// The action `verb` (`replay` or `purge`) asks for on queue `name` with `fields`: on the
/// selection `fields` name, or on the kept messages the index now shows for the filter
/// and keys they give.
fn action_request(
    app: &App,
    name: &str,
    verb: &str,
    fields: Vec<(String, String)>,
) -> Result<ActionRequest, (StatusCode, String)> {
    let queue = queue_of(app, name).map_err(|e| (StatusCode::NOT_FOUND, e))?;
    let action = match verb {
        "replay" => replay_action(&fields)?,
        "purge" => Action::Purge,
        other => {
            return Err((
                StatusCode::NOT_FOUND,
                format!("no action {other:?}: replay, purge or refresh"),
            ));
        }
    };
    let (selection, named) = match value(&fields, "selection") {
        Some(id) => {
            let found = app.selections.get(id, &queue.name, Instant::now());
            let found = found.ok_or_else(|| {
                (
                    StatusCode::GONE,
                    format!(
                        "selection {id:?} has expired (a selection waits {} minutes for its \
                         confirmation) or is not of queue {:?}: look at the messages again",
                        LIFETIME.as_secs() / 60,
                        queue.name
                    ),
                )
            })?;
            (found, true)
        }
        None => {
            let (filter, keys, description) =
                selection(&fields, true).map_err(|e| (StatusCode::BAD_REQUEST, e))?;
            let snap = queue.snapshot();
            let index = &snap.index;
            let chosen = Selection::new(
                &queue.name,
                description,
                index.select(&filter, &keys),
                (
                    index.started.filter(|_| snap.generation > 0),
                    snap.generation,
                    index.not_kept,
                ),
            )
            .map_err(|e| {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot draw a selection's name: {e}"),
                )
            })?;
            (Arc::new(chosen), false)
        }
    };
    Ok(ActionRequest {
        queue,
        action,
        selection,
        named,
        fields,
    })
}

fn replay_action(fields: &[(String, String)]) -> Result<Action, (StatusCode, String)> {
    let (slowest, fastest) = jobs::RATES;
    let rate = match value(fields, "rate") {
        Some(text) => match text.parse::<f64>() {
            Ok(r) if (slowest..=fastest).contains(&r) => Some(r),
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    format!(
                        "rate {text:?}: a number of messages a second from {slowest} to {fastest}"
                    ),
                ));
            }
        },
        None => None,
    };
    let dry_run = value(fields, "dry_run").is_some_and(|v| v != "0" && v != "false");
    Ok(Action::Replay { rate, dry_run })
}

/// The POST of a page's form: `replay`, `purge` or `refresh`. A purge shows its
/// confirmation first, naming the selection it made; with `confirm=yes` and that selection
/// it runs. A replay runs at once on what the page listed (its `generation` is the index's
/// still); else it too asks for a confirmation, with the count as the index now has it.
async fn form_post(
    State(app): State<Arc<App>>,
    axum::Extension(via): axum::Extension<Via>,
    Path((name, verb)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let fields = fields(&body);
    if let Some(refused) = check_csrf(&app, via, &headers, &fields) {
        return refused;
    }
    let refused = |(status, why): (StatusCode, String)| {
        page_error(&app, status, &format!("Nothing done: {verb}"), &why)
    };
    if verb == "refresh" {
        return match queue_of(&app, &name) {
            Ok(queue) => {
                queue.refresh_now();
                redirect(&format!("/q/{}", html::enc(&queue.name)))
            }
            Err(e) => refused((StatusCode::NOT_FOUND, e)),
        };
    }
    let r = match action_request(&app, &name, &verb, fields) {
        Ok(r) => r,
        Err(e) => return refused(e),
    };
    let confirmed = r.named && value(&r.fields, "confirm") == Some("yes");
    let as_listed =
        value(&r.fields, "generation").is_some_and(|g| g == r.selection.generation.to_string());
    let runs = match r.action {
        Action::Purge => confirmed,
        Action::Replay { dry_run, .. } => dry_run || confirmed || (!r.named && as_listed),
    };
    if !runs {
        app.selections.keep(&r.selection, Instant::now());
        return page(html::confirm_page(
            &app,
            &r.queue,
            r.action,
            &r.selection,
            !r.named && !as_listed && r.action != Action::Purge,
            &csrf_of(&app, Some(&via)),
        ));
    }
    let job = jobs::start(&app, &r.queue, r.action, &r.selection);
    redirect(&format!("/jobs/{}", job.id))
}

/// A job's cancellation, from its page's form.
async fn form_cancel(
    State(app): State<Arc<App>>,
    axum::Extension(via): axum::Extension<Via>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = check_csrf(&app, via, &headers, &fields(&body)) {
        return refused;
    }
    match job_numbered(&app, &id) {
        Some(job) => {
            job.cancel();
            redirect(&format!("/jobs/{}", job.id))
        }
        None => no_such_job(&app),
    }
}

async fn job_page(
    State(app): State<Arc<App>>,
    via: Option<axum::Extension<Via>>,
    Path(id): Path<String>,
) -> Response {
    match job_numbered(&app, &id) {
        Some(job) => page(html::job_page(&app, &job, &csrf_of(&app, via.as_deref()))),
        None => no_such_job(&app),
    }
}

/// The job numbered `id` in this run of the console.
fn job_numbered(app: &App, id: &str) -> Option<Arc<Job>> {
    id.parse().ok().and_then(|id| app.jobs.get(id))
}

/// The page that says no job is numbered so.
fn no_such_job(app: &App) -> Response {
    page_error(
        app,
        StatusCode::NOT_FOUND,
        "No such action",
        "No action has this number in this run of the console.",
    )
}

/// The API's answer that no job is numbered `id`.
fn no_such_job_api(id: &str) -> Response {
    api_error(
        StatusCode::NOT_FOUND,
        format!("no action {id:?} in this run of the console"),
    )
}

// ---- logging in ----

async fn login_get(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let fields = query_fields(&query);
    match value(&fields, "token") {
        Some(token) => log_in(&app, token),
        None => page(html::login_page(&app, false)),
    }
}

async fn login_post(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if !same_origin(&headers) {
        return (
            StatusCode::FORBIDDEN,
            "a login from another site's page is refused",
        )
            .into_response();
    }
    let fields = fields(&body);
    log_in(&app, value(&fields, "token").unwrap_or(""))
}

/// Starts a new session if `token` is the console's token: every login draws a session
/// id of its own.
fn log_in(app: &App, token: &str) -> Response {
    if !app.auth.is_token(token) {
        return with_status(page(html::login_page(app, true)), StatusCode::UNAUTHORIZED);
    }
    let session = match app.auth.log_in(Instant::now()) {
        Ok(session) => session,
        Err(e) => {
            return page_error(
                app,
                StatusCode::INTERNAL_SERVER_ERROR,
                "Not logged in",
                &format!("cannot draw a session id: {e}"),
            );
        }
    };
    let mut response = redirect("/");
    if let Ok(cookie) = HeaderValue::from_str(&app.auth.set_cookie(&session)) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// Ends the session of the cookie (the form must carry its CSRF token) and clears the
/// cookie. A request let in by the bearer token has no session to end.
async fn logout(
    State(app): State<Arc<App>>,
    axum::Extension(via): axum::Extension<Via>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = check_csrf(&app, via, &headers, &fields(&body)) {
        return refused;
    }
    if let Via::Cookie(session) = via {
        app.auth.log_out(&session);
    }
    let mut response = redirect("/login");
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(auth::CLEAR_COOKIE),
    );
    response
}

// ---- the JSON API ----

fn time_json(t: Option<retry_core::Timestamp>) -> Value {
    t.map_or(Value::Null, |t| json!(time_text(t)))
}

fn group_json(group: &Group) -> Value {
    json!({
        "key": group.key,
        "reason": if group.overflow { Value::Null } else { json!(group.reason.as_str()) },
        "error": group.fingerprint,
        "other": group.overflow,
        "count": group.count,
        "first_seen": time_json(group.first_seen),
        "last_seen": time_json(group.last_seen),
        "example": { "id": group.example_id, "error": group.example_error },
    })
}

fn queue_json(queue: &Queue, groups: Option<usize>) -> Value {
    let snap = queue.snapshot();
    let index = &snap.index;
    let building = queue
        .building
        .lock()
        .map(|b| {
            b.map(|(seen, since)| json!({ "read": seen, "seconds": since.elapsed().as_secs_f64() }))
        })
        .unwrap_or(None);
    let depths: Vec<Value> = queue
        .shown
        .iter()
        .zip(&snap.depths)
        .map(|((name, role), depth)| {
            let ready = match depth {
                Depth::Ready(n) => json!(n),
                Depth::Missing => json!("absent"),
                Depth::Unknown => Value::Null,
            };
            json!({ "queue": name, "role": role, "ready": ready })
        })
        .collect();
    json!({
        "queue": queue.name,
        "parking_queue": queue.parking,
        "as_of": time_json(index.started.filter(|_| snap.generation > 0)),
        "index": {
            "generation": snap.generation,
            "walk_seconds": index.took.as_secs_f64(),
            "read": index.total,
            "kept": index.entries.len(),
            "not_kept": index.not_kept,
            "bytes": index.bytes,
            "memory_cap": index.limits.memory_cap,
            "error": snap.error,
            "building": building,
        },
        "parked": index.total,
        "by_reason": index.by_reason,
        "oldest": time_json(index.oldest),
        "newest": time_json(index.newest),
        "without_time": index.no_time,
        "over_time": index.histogram(48).iter().map(|(t, n)| json!({ "from": time_text(*t), "count": n })).collect::<Vec<_>>(),
        "depths": depths,
        "groups": index.groups.iter().take(groups.unwrap_or(usize::MAX)).map(group_json).collect::<Vec<_>>(),
        "groups_total": index.groups.len(),
    })
}

fn entry_json(entry: &Entry, full: bool) -> Value {
    let (properties, headers) = entry.unpack();
    let mut value = record_json_of(entry.id(), &headers);
    if let Value::Object(fields) = &mut value {
        fields.insert("pos".into(), json!(entry.pos));
        fields.insert("key".into(), json!(entry.key.hex()));
        if full {
            fields.insert("properties".into(), properties_json(&properties));
            fields.insert(
                "headers".into(),
                Value::Object(
                    headers
                        .iter()
                        .map(|(k, v)| (k.to_owned(), header_json(v)))
                        .collect(),
                ),
            );
            let whole = entry.preview().len() == entry.body_len();
            let (kind, text) = html::body_view(entry.preview(), whole);
            fields.insert(
                "body".into(),
                json!({ "length": entry.body_len(), "shown": entry.preview().len(), "cut": !whole, "kind": kind, "text": text }),
            );
        }
    }
    value
}

async fn api_queues(State(app): State<Arc<App>>) -> Response {
    json_body(&Value::Array(
        app.queues.iter().map(|q| queue_json(q, Some(5))).collect(),
    ))
}

async fn api_queue(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match queue_of(&app, &name) {
        Ok(queue) => json_body(&queue_json(&queue, Some(5))),
        Err(e) => api_error(StatusCode::NOT_FOUND, e),
    }
}

async fn api_groups(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match queue_of(&app, &name) {
        Ok(queue) => json_body(&json!(
            queue
                .snapshot()
                .index
                .groups
                .iter()
                .map(group_json)
                .collect::<Vec<_>>()
        )),
        Err(e) => api_error(StatusCode::NOT_FOUND, e),
    }
}

async fn api_messages(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let queue = match queue_of(&app, &name) {
        Ok(q) => q,
        Err(e) => return api_error(StatusCode::NOT_FOUND, e),
    };
    let fields = query_fields(&query);
    let (filter, (sort, descending, page_no, per_page)) =
        match selection(&fields, false).and_then(|(f, _, _)| Ok((f, list_options(&fields)?))) {
            Ok(v) => v,
            Err(e) => return api_error(StatusCode::BAD_REQUEST, e),
        };
    let snap = queue.snapshot();
    let page = snap
        .index
        .page(&filter, sort, descending, page_no, per_page);
    json_body(&json!({
        "as_of": time_json(snap.index.started.filter(|_| snap.generation > 0)),
        "matched": page.matched,
        "not_kept": snap.index.not_kept,
        "page": page_no + 1,
        "per_page": per_page,
        "messages": page.entries.iter().map(|e| entry_json(e, false)).collect::<Vec<_>>(),
    }))
}

async fn api_message(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let queue = match queue_of(&app, &name) {
        Ok(q) => q,
        Err(e) => return api_error(StatusCode::NOT_FOUND, e),
    };
    let snap = queue.snapshot();
    match wanted(&snap, &query_fields(&query)) {
        Ok(entries) => json_body(&json!(
            entries
                .iter()
                .map(|e| entry_json(e, true))
                .collect::<Vec<_>>()
        )),
        Err((status, why)) => api_error(status, why),
    }
}

/// A JSON object's fields as form fields: arrays give one field per item; `true` is "1".
/// `"confirm"` is not a field: it says whether the body confirms, and only `true` does; any
/// other value of it is refused, so that `"confirm": "false"` never purges.
pub(super) fn json_fields(body: &[u8]) -> Result<(Vec<(String, String)>, bool), String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok((Vec::new(), false));
    }
    let Value::Object(object) =
        serde_json::from_slice::<Value>(body).map_err(|e| format!("the body is not JSON: {e}"))?
    else {
        return Err("the body must be a JSON object".into());
    };
    let mut out = Vec::new();
    let mut confirmed = false;
    for (name, value) in object {
        if name == "confirm" {
            match value {
                Value::Bool(true) => confirmed = true,
                other => {
                    return Err(format!(
                        "confirm: {other} does not confirm; only true does (or leave it out)"
                    ));
                }
            }
            continue;
        }
        let items = match value {
            Value::Array(items) => items,
            other => vec![other],
        };
        for item in items {
            let text = match item {
                Value::String(s) => s,
                Value::Bool(true) => "1".into(),
                Value::Bool(false) => continue,
                Value::Number(n) => n.to_string(),
                Value::Null => continue,
                other => {
                    return Err(format!(
                        "{name}: {other} is not a string, number or boolean"
                    ));
                }
            };
            out.push((name.clone(), text));
        }
    }
    Ok((out, confirmed))
}

fn job_json(job: &Job) -> Value {
    let p = job.progress();
    json!({
        "id": job.id,
        "url": format!("/api/jobs/{}", job.id),
        "queue": job.queue,
        "action": job.action.name(),
        "selection": job.selection,
        "started": time_text(job.started),
        "ended": time_json(p.ended),
        "done": p.done,
        "cancelled": p.cancelled,
        "selected": job.selected,
        "error": p.error,
        "report": {
            "seen": p.report.seen,
            "matched": p.report.matched,
            "replayed": p.report.replayed,
            "purged": p.report.purged,
            "left": p.report.left,
            "uncopyable": p.report.uncopyable,
        },
        "summary": (p.done && p.error.is_none()).then(|| html::report_line(job, &p.report)),
    })
}

/// `response` with `status`.
fn with_status(mut response: Response, status: StatusCode) -> Response {
    *response.status_mut() = status;
    response
}

/// A POST of the API: `replay`, `purge` or `refresh`; 202 once started. Both actions take
/// the selection the body names (`"selection"`, from a 409), or else the kept messages the
/// index now shows for the body's filter and keys. A purge without `"confirm": true` takes
/// nothing: 409, with the count and the selection to confirm.
async fn api_post(
    State(app): State<Arc<App>>,
    axum::Extension(via): axum::Extension<Via>,
    Path((name, verb)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if check_csrf(&app, via, &headers, &[]).is_some() {
        return api_error(
            StatusCode::FORBIDDEN,
            "a request let in by the session cookie needs the X-CSRF-Token header",
        );
    }
    let (fields, confirmed) = match json_fields(&body) {
        Ok(f) => f,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, e),
    };
    if verb == "refresh" {
        return match queue_of(&app, &name) {
            Ok(queue) => {
                let generation = queue.snapshot().generation;
                queue.refresh_now();
                let answer =
                    json!({ "queue": queue.name, "generation": generation, "requested": true });
                with_status(json_body(&answer), StatusCode::ACCEPTED)
            }
            Err(e) => api_error(StatusCode::NOT_FOUND, e),
        };
    }
    let r = match action_request(&app, &name, &verb, fields) {
        Ok(r) => r,
        Err((status, why)) => return api_error(status, why),
    };
    if r.action == Action::Purge && !confirmed {
        app.selections.keep(&r.selection, Instant::now());
        let answer = json!({
            "error": "a purge removes messages for good: send {\"selection\": ..., \"confirm\": true} to purge these",
            "would_purge": r.selection.count(),
            "selection": r.selection.id,
            "description": r.selection.description,
            "as_of": time_json(r.selection.as_of),
            "not_kept": r.selection.not_kept,
            "expires_in_seconds": LIFETIME.as_secs(),
        });
        return with_status(json_body(&answer), StatusCode::CONFLICT);
    }
    let job = jobs::start(&app, &r.queue, r.action, &r.selection);
    with_status(json_body(&job_json(&job)), StatusCode::ACCEPTED)
}

/// `POST /api/jobs/{id}/cancel`: stops the job before the next message it would take; 202,
/// with the job as it stands.
async fn api_cancel(
    State(app): State<Arc<App>>,
    axum::Extension(via): axum::Extension<Via>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if check_csrf(&app, via, &headers, &[]).is_some() {
        return api_error(
            StatusCode::FORBIDDEN,
            "a request let in by the session cookie needs the X-CSRF-Token header",
        );
    }
    match job_numbered(&app, &id) {
        Some(job) => {
            let status = if job.cancel() {
                StatusCode::ACCEPTED
            } else {
                StatusCode::CONFLICT
            };
            with_status(json_body(&job_json(&job)), status)
        }
        None => no_such_job_api(&id),
    }
}

async fn api_job(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match job_numbered(&app, &id) {
        Some(job) => json_body(&job_json(&job)),
        None => no_such_job_api(&id),
    }
}
