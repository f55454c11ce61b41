//! The console's pages, rendered on the server: no script at all, so the
//! Content-Security-Policy forbids every script.
//!
//! Markup is written only from `&'static str` ([`Html::raw`]); everything else, above all
//! what came from the network (ids, headers, errors, bodies), goes through [`Html::text`],
//! which escapes it for an element's text and a quoted attribute alike. Links carry values
//! percent-encoded ([`enc`]) and then escaped.

use std::fmt::Display;

use retry_core::{HeaderValue, ParkingReport, Timestamp, headers};
use serde_json::Value;

use super::auth::{VIEWER, Viewer};
use super::index::{Entry, Group, Index, Sort};
use super::jobs::{Action, Job};
use super::selection::Selection;
use retry_core::Depth;

use super::{App, Queue, Snapshot};
use crate::present::{one_line, properties_json, record_json_of, time_text};
use crate::render::{header_json, hex};

/// HTML under construction.
#[derive(Default)]
pub struct Html(String);

/// Escapes `text` for HTML text and double- or single-quoted attribute values.
pub fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
}

/// Percent-encodes `text` for a URL's path segment or query value: every byte but
/// `A-Z a-z 0-9 - . _ ~`.
pub fn enc(text: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

impl Html {
    /// Trusted markup: only literals.
    pub fn raw(&mut self, markup: &'static str) -> &mut Self {
        self.0.push_str(markup);
        self
    }

    /// Text, escaped.
    pub fn text(&mut self, text: &str) -> &mut Self {
        escape_into(&mut self.0, text);
        self
    }

    /// A number or other value whose text is escaped all the same.
    pub fn show(&mut self, value: impl Display) -> &mut Self {
        self.text(&value.to_string())
    }

    /// `<a href="HREF">TEXT</a>`, both escaped.
    pub fn link(&mut self, href: &str, text: &str) -> &mut Self {
        self.raw("<a href=\"")
            .text(href)
            .raw("\">")
            .text(text)
            .raw("</a>")
    }

    /// A hidden form field.
    pub fn hidden(&mut self, name: &'static str, value: &str) -> &mut Self {
        self.raw("<input type=\"hidden\" name=\"")
            .raw(name)
            .raw("\" value=\"")
            .text(value)
            .raw("\">")
    }

    /// The markup.
    pub fn into_string(self) -> String {
        self.0
    }
}

/// A time for people: RFC 3339 in UTC, to the second.
fn when(t: Option<Timestamp>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| {
            let text = time_text(t);
            // 2026-12-01T09:30:00.123Z -> 2026-12-01 09:30:00Z
            match (text.get(..10), text.get(11..19)) {
                (Some(day), Some(time)) => format!("{day} {time}Z"),
                _ => text,
            }
        },
    )
}

/// A duration for people: milliseconds under a second, else seconds.
fn took(d: std::time::Duration) -> String {
    if d < std::time::Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// A whole page: `title`, and `body`; `refresh` reloads it every that many seconds.
///
/// The header shows the broker, and the logout form of a session, only to a request the
/// console let in: only while [`VIEWER`] is set (see `http::authorize`), which holds for
/// whatever the handler of such a request renders on its own task. The login page, a 404
/// and every refusal show nothing of the broker.
pub fn page(app: &App, title: &str, refresh: Option<u32>, body: Html) -> String {
    let mut h = Html::default();
    h.raw("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">")
        .raw("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
    if let Some(seconds) = refresh {
        h.raw("<meta http-equiv=\"refresh\" content=\"")
            .show(seconds)
            .raw("\">");
    }
    h.raw("<title>")
        .text(title)
        .raw(" · retryctl</title><link rel=\"stylesheet\" href=\"/static/console.css\"></head><body>")
        .raw("<header><a class=\"home\" href=\"/\">retryctl console</a>");
    if let Ok(viewer) = VIEWER.try_with(Viewer::clone) {
        h.raw("<span class=\"broker\">")
            .text(&app.broker_shown)
            .raw("</span>");
        if let Some(csrf) = &viewer.csrf {
            h.raw("<form method=\"post\" action=\"/logout\" class=\"logout\">");
            csrf_field(&mut h, csrf);
            h.raw("<button type=\"submit\">Log out</button></form>");
        }
    }
    h.raw("</header><main>");
    h.0.push_str(&body.0);
    h.raw("</main></body></html>\n");
    h.into_string()
}

/// The CSRF field of every form that changes something.
fn csrf_field(h: &mut Html, csrf: &str) {
    h.hidden("csrf", csrf);
}

fn depth_text(depth: &Depth) -> String {
    match depth {
        Depth::Ready(n) => n.to_string(),
        Depth::Missing => "absent".into(),
        Depth::Unknown => "not counted over this transport".into(),
    }
}

/// "as of" line, the walk under way, and the last walk's error.
fn freshness(h: &mut Html, queue: &Queue, snap: &Snapshot, csrf: &str) {
    h.raw("<p class=\"asof\">");
    match snap.index.started {
        Some(t) if snap.generation > 0 => {
            h.raw("As of ").text(&when(Some(t))).raw(" (walk of ");
            h.show(snap.index.total)
                .raw(" messages took ")
                .text(&took(snap.index.took))
                .raw(").");
        }
        _ => {
            h.raw("Not read yet.");
        }
    }
    if let Some((seen, since)) = *queue.building.lock().unwrap_or_else(|e| e.into_inner()) {
        h.raw(" <span class=\"building\">Reading the queue: ")
            .show(seen)
            .raw(" read in ")
            .show(format!("{:.0} s", since.elapsed().as_secs_f64()))
            .raw("…</span>");
    }
    h.raw("</p>");
    if let Some(error) = &snap.error {
        h.raw("<p class=\"error\">The last walk failed: ")
            .text(error)
            .raw("</p>");
    }
    if snap.index.not_kept > 0 {
        h.raw("<p class=\"warning\" id=\"not-kept\">")
            .show(snap.index.not_kept)
            .raw(" of ")
            .show(snap.index.total)
            .raw(" messages did not fit the index's memory cap (")
            .show(snap.index.limits.memory_cap >> 20)
            .raw(" MiB, --index-memory): they are counted here and in the groups, but not listed, and replays and purges from this console do not take them.</p>");
    }
    h.raw("<form method=\"post\" action=\"/q/")
        .text(&enc(&queue.name))
        .raw("/refresh\" class=\"inline\">");
    csrf_field(h, csrf);
    h.raw("<button type=\"submit\">Read again now</button></form>");
}

/// A bar chart of parked messages over time, as inline SVG (no script, no style).
fn chart(h: &mut Html, index: &Index) {
    let bars = index.histogram(48);
    if bars.is_empty() {
        h.raw("<p class=\"muted\">No parking times to chart.</p>");
        return;
    }
    let max = bars.iter().map(|b| b.1).max().unwrap_or(1).max(1);
    let (width, height) = (480u64, 80u64);
    let bar_w = (width / bars.len() as u64).max(1);
    h.raw("<figure class=\"chart\"><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"")
        .show(width)
        .raw("\" height=\"")
        .show(height + 2)
        .raw("\" role=\"img\" aria-label=\"parked messages over time\">");
    for (i, (start, n)) in bars.iter().enumerate() {
        let bh = (n * height).div_ceil(max);
        h.raw("<rect x=\"")
            .show(i as u64 * bar_w)
            .raw("\" y=\"")
            .show(height - bh)
            .raw("\" width=\"")
            .show(bar_w.saturating_sub(1).max(1))
            .raw("\" height=\"")
            .show(bh)
            .raw("\"><title>")
            .show(n)
            .raw(" parked from ")
            .text(&when(Some(*start)))
            .raw("</title></rect>");
    }
    h.raw("<line x1=\"0\" x2=\"")
        .show(width)
        .raw("\" y1=\"")
        .show(height + 1)
        .raw("\" y2=\"")
        .show(height + 1)
        .raw("\"/></svg><figcaption>")
        .text(&when(bars.first().map(|b| b.0)))
        .raw(" → ")
        .text(&when(index.newest))
        .raw(", ")
        .show(bars.len())
        .raw(" bars, highest ")
        .show(max)
        .raw("</figcaption></figure>");
}

fn queue_href(queue: &str) -> String {
    format!("/q/{}", enc(queue))
}

fn group_href(queue: &str, group: &Group) -> String {
    format!("/q/{}/groups/{}", enc(queue), enc(&group.key))
}

fn message_href(queue: &str, entry: &Entry) -> String {
    match entry.id() {
        Some(id) => format!("/q/{}/message?id={}", enc(queue), enc(id)),
        None => format!("/q/{}/message?pos={}", enc(queue), entry.pos),
    }
}

fn group_label(group: &Group) -> String {
    if group.overflow {
        "(other errors, beyond the group limit)".into()
    } else if group.fingerprint.is_empty() {
        "(no error recorded)".into()
    } else {
        group.fingerprint.clone()
    }
}

/// The table of groups, with links.
fn groups_table(h: &mut Html, queue: &str, index: &Index, limit: usize) {
    h.raw("<table class=\"groups\"><thead><tr><th>Reason</th><th>Error</th><th class=\"n\">Count</th><th>First seen</th><th>Last seen</th></tr></thead><tbody>");
    for group in index.groups.iter().take(limit) {
        h.raw("<tr><td>")
            .text(group.reason.as_str())
            .raw("</td><td class=\"err\">")
            .link(&group_href(queue, group), &group_label(group))
            .raw("</td><td class=\"n\">")
            .show(group.count)
            .raw("</td><td>")
            .text(&when(group.first_seen))
            .raw("</td><td>")
            .text(&when(group.last_seen))
            .raw("</td></tr>");
    }
    h.raw("</tbody></table>");
    if index.groups.len() > limit {
        h.raw("<p>")
            .link(
                &queue_href(queue),
                &format!("All {} groups", index.groups.len()),
            )
            .raw("</p>");
    }
}

/// The overview: every queue's counts, chart, depths and largest groups.
pub fn overview(app: &App, csrf: &str) -> String {
    let mut h = Html::default();
    h.raw("<h1>Parking lots</h1>");
    for queue in &app.queues {
        let snap = queue.snapshot();
        let index = &snap.index;
        h.raw("<section class=\"queue\" id=\"queue-")
            .text(&enc(&queue.name))
            .raw("\"><h2>")
            .link(&queue_href(&queue.name), &queue.name)
            .raw(" <span class=\"count\">")
            .show(index.total)
            .raw(" parked</span></h2>");
        freshness(&mut h, queue, &snap, csrf);
        h.raw("<div class=\"cols\"><div><h3>By reason</h3><table class=\"reasons\"><tbody>");
        for (reason, n) in &index.by_reason {
            h.raw("<tr><td>")
                .link(
                    &format!("/q/{}/messages?reason={}", enc(&queue.name), enc(reason)),
                    reason,
                )
                .raw("</td><td class=\"n\">")
                .show(n)
                .raw("</td></tr>");
        }
        h.raw("</tbody></table><p>Oldest parked: ")
            .text(&when(index.oldest))
            .raw("<br>Newest parked: ")
            .text(&when(index.newest))
            .raw("</p></div><div><h3>Parked over time</h3>");
        chart(&mut h, index);
        h.raw("</div><div><h3>Queues</h3><table class=\"depths\"><tbody>");
        for ((name, role), depth) in queue.shown.iter().zip(&snap.depths) {
            h.raw("<tr><td>")
                .text(name)
                .raw("</td><td class=\"muted\">")
                .text(role)
                .raw("</td><td class=\"n\">")
                .text(&depth_text(depth))
                .raw("</td></tr>");
        }
        h.raw("</tbody></table></div></div><h3>Largest failure groups</h3>");
        groups_table(&mut h, &queue.name, index, 5);
        h.raw("<p>")
            .link(
                &format!("/q/{}/messages", enc(&queue.name)),
                "List every parked message",
            )
            .raw("</p></section>");
    }
    let jobs = app.jobs.recent(10);
    if !jobs.is_empty() {
        h.raw("<h2>Recent actions</h2><ul class=\"jobs\">");
        for job in jobs {
            h.raw("<li>")
                .link(&format!("/jobs/{}", job.id), &job_title(&job))
                .raw("</li>");
        }
        h.raw("</ul>");
    }
    page(app, "Overview", None, h)
}

/// A queue's page: its freshness and every failure group.
pub fn queue_page(app: &App, queue: &Queue, csrf: &str) -> String {
    let snap = queue.snapshot();
    let mut h = Html::default();
    h.raw("<h1>")
        .text(&queue.name)
        .raw(" <span class=\"count\">")
        .show(snap.index.total)
        .raw(" parked</span></h1>");
    freshness(&mut h, queue, &snap, csrf);
    h.raw("<h2>Failure groups</h2>");
    groups_table(&mut h, &queue.name, &snap.index, usize::MAX);
    h.raw("<p>")
        .link(
            &format!("/q/{}/messages", enc(&queue.name)),
            "List every parked message",
        )
        .raw("</p>");
    page(app, &queue.name, None, h)
}

/// The fields that select a group, a filter, some ids or everything, as hidden inputs.
pub fn selection_fields(h: &mut Html, fields: &[(String, String)]) {
    for (name, value) in fields {
        let name: &'static str = match name.as_str() {
            "ids" => "ids",
            "id" => "id",
            "key" => "key",
            "reason" => "reason",
            "group" => "group",
            "error" => "error",
            "after" => "after",
            "before" => "before",
            "all" => "all",
            _ => continue,
        };
        h.hidden(name, value);
    }
}

/// The replay form (with a rate and a dry run) and the purge button for a selection, as the
/// index of walk `generation` shows it.
fn action_forms(
    h: &mut Html,
    queue: &str,
    selection: &[(String, String)],
    what: &str,
    generation: u64,
    csrf: &str,
) {
    let (slowest, fastest) = crate::serve::jobs::RATES;
    h.raw("<div class=\"actions\"><form method=\"post\" class=\"replay\" action=\"/q/")
        .text(&enc(queue))
        .raw("/replay\">");
    csrf_field(h, csrf);
    selection_fields(h, selection);
    h.hidden("generation", &generation.to_string());
    h.raw("<label>At most <input type=\"number\" name=\"rate\" min=\"")
        .show(slowest)
        .raw("\" max=\"")
        .show(fastest)
        .raw("\" step=\"any\" placeholder=\"unlimited\"> a second</label> ")
        .raw("<button type=\"submit\" name=\"dry_run\" value=\"1\" class=\"dry-run\">Dry run</button> ")
        .raw("<button type=\"submit\" class=\"replay\">Replay ")
        .text(what)
        .raw("</button></form><form method=\"post\" class=\"purge\" action=\"/q/")
        .text(&enc(queue))
        .raw("/purge\">");
    csrf_field(h, csrf);
    selection_fields(h, selection);
    h.raw("<button type=\"submit\" class=\"purge\">Purge ")
        .text(what)
        .raw("…</button></form></div>");
}

/// A group's page.
pub fn group_page(app: &App, queue: &Queue, group: &Group, csrf: &str) -> String {
    let snap = queue.snapshot();
    let mut h = Html::default();
    h.raw("<p class=\"crumbs\">")
        .link(&queue_href(&queue.name), &queue.name)
        .raw(" › failure group</p><h1 class=\"err\">")
        .text(&group_label(group))
        .raw("</h1>");
    freshness(&mut h, queue, &snap, csrf);
    h.raw("<table class=\"facts\"><tbody><tr><th>Reason</th><td>")
        .text(group.reason.as_str())
        .raw("</td></tr><tr><th>Count</th><td id=\"group-count\">")
        .show(group.count)
        .raw("</td></tr><tr><th>First seen</th><td>")
        .text(&when(group.first_seen))
        .raw("</td></tr><tr><th>Last seen</th><td>")
        .text(&when(group.last_seen))
        .raw("</td></tr><tr><th>Example</th><td>");
    match &group.example_id {
        Some(id) => {
            h.link(
                &format!("/q/{}/message?id={}", enc(&queue.name), enc(id)),
                id,
            );
        }
        None => {
            h.raw("(no message id)");
        }
    }
    h.raw("<pre class=\"example\">")
        .text(
            group
                .example_error
                .as_deref()
                .unwrap_or("(no error recorded)"),
        )
        .raw("</pre></td></tr></tbody></table>");
    let selection = group_selection(group);
    match &selection {
        Some(fields) => action_forms(
            &mut h,
            &queue.name,
            fields,
            "this group",
            snap.generation,
            csrf,
        ),
        None => {
            h.raw("<p class=\"muted\">This group gathers the errors beyond the group limit: no filter selects it. Act on its messages from the list.</p>");
        }
    }
    if let Some(filter) = group.filter() {
        let page = snap.index.page(&filter, Sort::Position, false, 0, 50);
        h.raw("<h2>Messages</h2>");
        message_table(&mut h, &queue.name, &page.entries, None);
        if page.matched > 50 {
            let mut href = format!("/q/{}/messages", enc(&queue.name));
            if let Some(fields) = &selection {
                href.push('?');
                href.push_str(&query(fields));
            }
            h.raw("<p>")
                .link(&href, &format!("All {} in the list", page.matched))
                .raw("</p>");
        }
    }
    page(app, &group_label(group), None, h)
}

/// The selection fields of a group, `None` for the overflow group.
pub fn group_selection(group: &Group) -> Option<Vec<(String, String)>> {
    (!group.overflow).then(|| {
        vec![
            ("reason".to_owned(), group.reason.as_str().to_owned()),
            ("group".to_owned(), group.fingerprint.clone()),
        ]
    })
}

/// Fields as a query string.
pub fn query(fields: &[(String, String)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The table of messages; with `sort_links`, sortable columns and a checkbox each, in the
/// form `selected`.
fn message_table(
    h: &mut Html,
    queue: &str,
    entries: &[&Entry],
    sort_links: Option<&dyn Fn(Sort) -> String>,
) {
    let head = |h: &mut Html, sort: Sort, label: &'static str| {
        h.raw("<th>");
        match sort_links {
            Some(link) => {
                h.raw("<a href=\"")
                    .text(&link(sort))
                    .raw("\">")
                    .raw(label)
                    .raw("</a>");
            }
            None => {
                h.raw(label);
            }
        }
        h.raw("</th>");
    };
    h.raw("<table class=\"messages\"><thead><tr>");
    if sort_links.is_some() {
        h.raw("<th></th>");
    }
    head(h, Sort::Id, "Id");
    head(h, Sort::Reason, "Reason");
    head(h, Sort::Attempts, "Attempts");
    head(h, Sort::ParkedAt, "Parked at");
    h.raw("<th>Last error</th></tr></thead><tbody>");
    for entry in entries {
        h.raw("<tr>");
        if sort_links.is_some() {
            h.raw("<td>");
            h.raw("<input type=\"checkbox\" form=\"selected\" name=\"key\" value=\"")
                .text(&entry.key.hex())
                .raw("\" aria-label=\"select\"></td>");
        }
        h.raw("<td class=\"id\">")
            .link(&message_href(queue, entry), entry.id().unwrap_or("(no id)"))
            .raw("</td><td>")
            .text(entry.reason.as_str())
            .raw("</td><td class=\"n\">")
            .text(&entry.attempts.map_or_else(|| "-".into(), |n| n.to_string()))
            .raw("</td><td>")
            .text(&when(entry.parked_at))
            .raw("</td><td class=\"err\">")
            .text(&one_line(entry.last_error().unwrap_or("-"), 160))
            .raw("</td></tr>");
    }
    h.raw("</tbody></table>");
}

/// What a list shows: the filter's fields, the order and the page.
pub struct ListView<'a> {
    /// The filter's fields, as given.
    pub fields: &'a [(String, String)],
    /// The filter they make.
    pub filter: &'a retry_core::ParkedFilter,
    /// The order.
    pub sort: Sort,
    /// Whether reversed.
    pub descending: bool,
    /// The page, from 0.
    pub page: usize,
    /// Messages a page.
    pub per_page: usize,
}

/// The list page.
pub fn list_page(app: &App, queue: &Queue, view: &ListView<'_>, csrf: &str) -> String {
    let snap = queue.snapshot();
    let index = &snap.index;
    let result = index.page(
        view.filter,
        view.sort,
        view.descending,
        view.page,
        view.per_page,
    );
    let base = format!("/q/{}/messages", enc(&queue.name));
    let value = |name: &str| {
        view.fields
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.as_str())
    };
    let mut h = Html::default();
    h.raw("<p class=\"crumbs\">")
        .link(&queue_href(&queue.name), &queue.name)
        .raw(" › messages</p><h1>Parked messages</h1>");
    freshness(&mut h, queue, &snap, csrf);
    // The filter: a GET form, so a filtered list is a link.
    h.raw("<form method=\"get\" class=\"filter\" action=\"")
        .text(&base)
        .raw("\"><label>Reason <select name=\"reason\"><option value=\"\">any</option>");
    for reason in [
        "attempts-exhausted",
        "max-elapsed",
        "permanent",
        "crash-loop",
        "unknown",
        "malformed",
    ] {
        h.raw("<option");
        if value("reason") == reason {
            h.raw(" selected");
        }
        h.raw(">").text(reason).raw("</option>");
    }
    h.raw("</select></label> <label>Error contains <input name=\"error\" value=\"")
        .text(value("error"))
        .raw("\"></label> <label>Id <input name=\"id\" value=\"")
        .text(value("id"))
        .raw("\"></label> <label>Parked after <input name=\"after\" placeholder=\"2h or 2026-12-01T09:30:00Z\" value=\"")
        .text(value("after"))
        .raw("\"></label> <label>before <input name=\"before\" value=\"")
        .text(value("before"))
        .raw("\"></label>");
    if view.fields.iter().any(|(k, _)| k == "group") {
        h.hidden("group", value("group"));
    }
    h.raw(" <button type=\"submit\">Filter</button></form>");
    // The filter as given, ids from a link included: what "all that match" takes.
    let filtered: Vec<(String, String)> = view
        .fields
        .iter()
        .filter(|(k, v)| {
            ["ids", "id", "reason", "error", "after", "before"].contains(&k.as_str())
                && !v.is_empty()
                || k == "group"
        })
        .cloned()
        .collect();
    h.raw("<p class=\"matched\"><span id=\"matched\">")
        .show(result.matched)
        .raw("</span> match");
    if index.not_kept > 0 {
        h.raw(" among the ")
            .show(index.entries.len())
            .raw(" indexed");
    }
    h.raw(".</p>");
    let sort_link = |sort: Sort| {
        let descending = sort == view.sort && !view.descending;
        let mut fields = filtered.clone();
        fields.push(("sort".into(), sort.name().into()));
        if descending {
            fields.push(("dir".into(), "desc".into()));
        }
        format!("{base}?{}", query(&fields))
    };
    // The selected messages' form; the checkboxes join it by its id.
    h.raw("<form method=\"post\" id=\"selected\" class=\"selected\" action=\"/q/")
        .text(&enc(&queue.name))
        .raw("/replay\">");
    csrf_field(&mut h, csrf);
    h.hidden("generation", &snap.generation.to_string());
    h.raw("<button type=\"submit\" class=\"replay-selected\">Replay selected</button> <button type=\"submit\" class=\"purge-selected\" formaction=\"/q/")
        .text(&enc(&queue.name))
        .raw("/purge\">Purge selected…</button></form>");
    message_table(&mut h, &queue.name, &result.entries, Some(&sort_link));
    // Pages.
    let pages = (result.matched as usize).div_ceil(view.per_page.max(1));
    if pages > 1 {
        h.raw("<nav class=\"pages\">Page ")
            .show(view.page + 1)
            .raw(" of ")
            .show(pages)
            .raw(" ");
        let page_link = |n: usize| {
            let mut fields = filtered.clone();
            fields.push(("sort".into(), view.sort.name().into()));
            if view.descending {
                fields.push(("dir".into(), "desc".into()));
            }
            fields.push(("page".into(), (n + 1).to_string()));
            format!("{base}?{}", query(&fields))
        };
        if view.page > 0 {
            h.link(&page_link(view.page - 1), "‹ previous").raw(" ");
        }
        if view.page + 1 < pages {
            h.link(&page_link(view.page + 1), "next ›");
        }
        h.raw("</nav>");
    }
    if filtered.is_empty() {
        action_forms(
            &mut h,
            &queue.name,
            &[("all".into(), "1".into())],
            "all",
            snap.generation,
            csrf,
        );
    } else {
        action_forms(
            &mut h,
            &queue.name,
            &filtered,
            "all that match",
            snap.generation,
            csrf,
        );
    }
    page(app, "Parked messages", None, h)
}

/// A header value as text: strings as they are, times with their date.
fn header_text(name: &str, value: &HeaderValue) -> String {
    let json = header_json(value);
    let mut text = match &json {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if [
        headers::FIRST_FAILURE,
        headers::LAST_FAILURE,
        headers::REPLAYED_AT,
    ]
    .contains(&name)
        && let Some(ms) = value.as_u64()
    {
        text = format!("{text} ({})", when(Some(Timestamp::from_millis(ms))));
    }
    text
}

/// A table of name and value rows.
fn pairs(h: &mut Html, class: &'static str, rows: &[(String, String)]) {
    h.raw("<table class=\"").raw(class).raw("\"><tbody>");
    for (name, value) in rows {
        h.raw("<tr><th>")
            .text(name)
            .raw("</th><td>")
            .text(value)
            .raw("</td></tr>");
    }
    h.raw("</tbody></table>");
}

fn json_rows(value: Value) -> Vec<(String, String)> {
    let Value::Object(fields) = value else {
        return Vec::new();
    };
    fields
        .into_iter()
        .filter(|(_, v)| !v.is_null() && *v != Value::Array(Vec::new()))
        .map(|(k, v)| {
            let text = match v {
                Value::String(s) => s,
                other => other.to_string(),
            };
            (k, text)
        })
        .collect()
}

/// The body as the message page shows it: pretty JSON, text or a hex dump, of the kept
/// preview; and what kind it is.
pub fn body_view(preview: &[u8], whole: bool) -> (&'static str, String) {
    if whole && let Ok(json) = serde_json::from_slice::<Value>(preview) {
        return (
            "JSON",
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        );
    }
    // A preview cut inside a character is still text.
    let text = match std::str::from_utf8(preview) {
        Ok(text) => Some(text),
        Err(e) if !whole && e.error_len().is_none() => {
            std::str::from_utf8(&preview[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    match text {
        Some(text) if !text.chars().any(|c| c.is_control() && !c.is_whitespace()) => {
            ("text", text.to_owned())
        }
        _ => {
            use std::fmt::Write as _;
            let mut out = String::new();
            for (i, chunk) in preview.chunks(16).enumerate() {
                let _ = writeln!(out, "{:08x}  {}", i * 16, hex(chunk));
            }
            ("binary, in hex", out)
        }
    }
}

/// A message's page.
pub fn message_page(app: &App, queue: &Queue, entries: &[&Entry], csrf: &str) -> String {
    let snap = queue.snapshot();
    let mut h = Html::default();
    h.raw("<p class=\"crumbs\">")
        .link(&queue_href(&queue.name), &queue.name)
        .raw(" › ")
        .link(&format!("/q/{}/messages", enc(&queue.name)), "messages")
        .raw(" › message</p>");
    freshness(&mut h, queue, &snap, csrf);
    if entries.len() > 1 {
        h.raw("<p class=\"warning\">").show(entries.len()).raw(
            " parked messages have this id; each is shown, with buttons that act on it alone.</p>",
        );
    }
    for entry in entries {
        let (properties, headers) = entry.unpack();
        let headers = &headers;
        h.raw("<article class=\"message\"><h1 class=\"id\">")
            .text(entry.id().unwrap_or("(no message id)"))
            .raw("</h1><h2>Record</h2>");
        pairs(
            &mut h,
            "record",
            &json_rows(record_json_of(entry.id(), headers)),
        );
        let replays = replay_history(headers);
        h.raw("<h2>Replay history</h2>");
        if replays.is_empty() {
            h.raw("<p class=\"muted\">Never replayed.</p>");
        } else {
            pairs(&mut h, "history", &replays);
        }
        h.raw("<h2>Properties</h2>");
        pairs(
            &mut h,
            "properties",
            &json_rows(properties_json(&properties)),
        );
        h.raw("<h2>Headers</h2>");
        let rows: Vec<(String, String)> = headers
            .iter()
            .map(|(name, value)| (name.to_owned(), header_text(name, value)))
            .collect();
        pairs(&mut h, "headers", &rows);
        let whole = entry.preview().len() == entry.body_len();
        let (kind, shown) = body_view(entry.preview(), whole);
        h.raw("<h2>Body</h2><p class=\"muted\">")
            .show(entry.body_len())
            .raw(" bytes, ")
            .text(kind);
        if !whole {
            h.raw("; the first ")
                .show(entry.preview().len())
                .raw(" bytes are shown (--preview-bytes)");
        }
        h.raw("</p><pre class=\"body\">").text(&shown).raw("</pre>");
        // Named by its key: another message with the same id is not touched.
        let fields = vec![("key".to_owned(), entry.key.hex())];
        action_forms(
            &mut h,
            &queue.name,
            &fields,
            "this message",
            snap.generation,
            csrf,
        );
        h.raw("</article>");
    }
    page(app, "Message", None, h)
}

/// The replay history of a parked message, as rows.
fn replay_history(headers: &retry_core::Headers) -> Vec<(String, String)> {
    let r = retry_core::ParkedRecord::decode(headers);
    let mut rows = Vec::new();
    if r.replays > 0 {
        rows.push(("replays".into(), r.replays.to_string()));
    }
    if let Some(t) = r.replayed_at {
        rows.push(("last replayed at".into(), when(Some(t))));
    }
    if let Some(reason) = r.previous_reason {
        rows.push(("parked before for".into(), reason.to_owned()));
    }
    if let Some(error) = r.previous_error {
        rows.push(("with the error".into(), error.to_owned()));
    }
    rows
}

/// The confirmation an action asks for: exactly which messages, as of the index. A purge
/// always asks; a replay asks when the index was read again since its page was shown
/// (`changed`).
pub fn confirm_page(
    app: &App,
    queue: &Queue,
    action: Action,
    selection: &Selection,
    changed: bool,
    csrf: &str,
) -> String {
    let (verb, class) = match action {
        Action::Purge => ("Purge", "purge-confirm danger"),
        Action::Replay { .. } => ("Replay", "replay-confirm"),
    };
    let mut h = Html::default();
    h.raw("<h1>")
        .text(verb)
        .raw(" from ")
        .text(&queue.parking)
        .raw("?</h1>");
    if changed {
        h.raw("<p class=\"warning\" id=\"changed\">The queue was read again since that page was shown: here is what the index holds now.</p>");
    }
    h.raw("<p class=\"confirm\">This ")
        .raw(match action {
            Action::Purge => "removes for good",
            Action::Replay { .. } => "replays to the work queue",
        })
        .raw(" <strong id=\"confirm-count\">")
        .show(selection.count())
        .raw("</strong> parked messages (")
        .text(&selection.description)
        .raw("), as listed in the index");
    if let Some(t) = selection.as_of {
        h.raw(" as of ").text(&when(Some(t)));
    }
    h.raw(". It takes these messages and no others: one parked since, even one that matches, stays; one gone since is not found.</p>");
    if selection.not_kept > 0 {
        h.raw("<p class=\"warning\">The index holds ")
            .show(selection.not_kept)
            .raw(" fewer messages than the walk read (--index-memory): those are not taken.</p>");
    }
    h.raw("<form method=\"post\" action=\"/q/")
        .text(&enc(&queue.name))
        .raw("/")
        .raw(match action {
            Action::Purge => "purge",
            Action::Replay { .. } => "replay",
        })
        .raw("\">");
    csrf_field(&mut h, csrf);
    h.hidden("selection", &selection.id);
    if let Action::Replay {
        rate: Some(rate), ..
    } = action
    {
        h.hidden("rate", &rate.to_string());
    }
    h.raw("<input type=\"hidden\" name=\"confirm\" value=\"yes\"><button type=\"submit\" class=\"")
        .raw(class)
        .raw("\">")
        .text(verb)
        .raw(" ")
        .show(selection.count())
        .raw(" messages</button> ")
        .link(&queue_href(&queue.name), "Cancel")
        .raw("</form>");
    page(app, &format!("Confirm {}", action.name()), None, h)
}

fn job_title(job: &Job) -> String {
    format!(
        "#{} {} of {} ({})",
        job.id,
        job.action.name(),
        job.queue,
        job.selection
    )
}

/// The report as the CLI prints it; a cancelled job says so first.
pub fn report_line(job: &Job, report: &ParkingReport) -> String {
    let parking = retry_core::TopologyPlan::parking_queue_of(&job.queue);
    let line = report_words(job, report, &parking);
    if job.progress().cancelled {
        format!("cancelled: {line}")
    } else {
        line
    }
}

fn report_words(job: &Job, report: &ParkingReport, parking: &str) -> String {
    match job.action {
        Action::Replay { dry_run: true, .. } => format!(
            "dry run: {} would be replayed to {}; replayed 0, left {} in {parking}",
            report.matched, job.queue, report.left
        ),
        Action::Replay { .. } => crate::present::replay_line(report, &job.queue, parking),
        Action::Purge => format!(
            "purged {}, left {} in {parking}",
            report.purged, report.left
        ),
    }
}

/// A job's page: progress while it runs (the page reloads itself), its report when done.
pub fn job_page(app: &App, job: &Job, csrf: &str) -> String {
    let progress = job.progress();
    let mut h = Html::default();
    h.raw("<h1>").text(&job_title(job)).raw("</h1>");
    let r = &progress.report;
    if !progress.done {
        h.raw("<p class=\"running\" id=\"job-state\">Running: ")
            .show(r.seen)
            .raw(" read, ")
            .show(r.matched)
            .raw(" of ")
            .show(job.selected)
            .raw(" selected taken…</p><form method=\"post\" class=\"inline\" action=\"/jobs/")
            .show(job.id)
            .raw("/cancel\">");
        csrf_field(&mut h, csrf);
        h.raw("<button type=\"submit\" class=\"cancel\">Cancel</button></form>");
    } else if let Some(error) = &progress.error {
        h.raw("<p class=\"error\" id=\"job-state\">Failed: ")
            .text(error)
            .raw("</p>");
    } else {
        h.raw("<p class=\"done\" id=\"job-state\">")
            .text(&report_line(job, r))
            .raw("</p>");
    }
    pairs(
        &mut h,
        "report",
        &[
            ("selected".into(), job.selected.to_string()),
            ("seen".into(), r.seen.to_string()),
            ("matched".into(), r.matched.to_string()),
            ("replayed".into(), r.replayed.to_string()),
            ("purged".into(), r.purged.to_string()),
            ("left".into(), r.left.to_string()),
        ],
    );
    h.raw("<p>Started ").text(&when(Some(job.started)));
    if let Some(t) = progress.ended {
        h.raw(", ended ").text(&when(Some(t)));
    }
    h.raw(". ")
        .link(&queue_href(&job.queue), "Back to the queue")
        .raw("</p>");
    page(app, "Action", (!progress.done).then_some(1), h)
}

/// The login page.
pub fn login_page(app: &App, failed: bool) -> String {
    let mut h = Html::default();
    h.raw("<h1>Log in</h1>");
    if failed {
        h.raw("<p class=\"error\" id=\"login-failed\">That is not the console's token.</p>");
    }
    h.raw("<form method=\"post\" action=\"/login\" class=\"login\"><label>Token <input type=\"password\" name=\"token\" autocomplete=\"off\" autofocus></label> <button type=\"submit\">Log in</button></form><p class=\"muted\">The token is the one given to <code>retryctl serve</code> (--token, --token-file or RETRYCTL_TOKEN), or the one it printed at start.</p>");
    page(app, "Log in", None, h)
}

/// A page that says what went wrong.
pub fn error_page(app: &App, title: &str, text: &str) -> String {
    let mut h = Html::default();
    h.raw("<h1>")
        .text(title)
        .raw("</h1><p class=\"error\">")
        .text(text)
        .raw("</p><p>")
        .link("/", "Overview")
        .raw("</p>");
    page(app, title, None, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_elements_and_attributes() {
        let mut h = Html::default();
        h.raw("<p title=\"")
            .text("\"><img src=x onerror=alert(1)>")
            .raw("\">")
            .text("<script>alert('x')</script> & more")
            .raw("</p>");
        assert_eq!(
            h.into_string(),
            "<p title=\"&quot;&gt;&lt;img src=x onerror=alert(1)&gt;\">&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; more</p>"
        );
    }

    #[test]
    fn values_in_links_are_percent_encoded() {
        assert_eq!(enc("javascript:alert(1)"), "javascript%3Aalert%281%29");
        assert_eq!(enc("a b/c?d=e&f"), "a%20b%2Fc%3Fd%3De%26f");
        assert_eq!(enc("é"), "%C3%A9");
        assert_eq!(enc("Az09-._~"), "Az09-._~");
    }

    #[test]
    fn a_body_is_json_text_or_hex() {
        assert_eq!(
            body_view(br#"{"a":1}"#, true),
            ("JSON", "{\n  \"a\": 1\n}".to_owned())
        );
        // A cut preview is never parsed as JSON, and a character cut in two is dropped.
        assert_eq!(
            body_view("{\"é".as_bytes().get(..3).unwrap(), false),
            ("text", "{\"".to_owned())
        );
        assert_eq!(body_view(b"plain", true).0, "text");
        let (kind, text) = body_view(&[0, 1, 0xff], true);
        assert_eq!(kind, "binary, in hex");
        assert!(text.starts_with("00000000  0001ff"), "{text}");
    }
}
