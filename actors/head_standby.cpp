// The standby head ([cluster] standby) and the journal it follows.
//
// The head keeps a journal of every job it accepted and has not seen end:
// what its scheduler was given (tokens, images, parameters). The standby,
// started with head_config::standby, joins the head's gatekeeper as its
// node, asks to follow (follow_atom: the journal so far), then receives
// each job begun and ended (journal_atom) and asks again every heartbeat.
// When the head's connection closes, or it answers none for
// membership.lost_after, the standby takes over: a term above the head's,
// its own name as the head, a fresh placement on the nodes that answer
// (each drops what the old head placed when the new term orders it).
// Clients (actors::client with a failover) find the standby's door and
// attach each open job with the tokens they received: the job runs again
// from those (generate_request::resumed), so its stream goes on with the
// next token. A job whose client does not come back within attach_wait is
// dropped.

#include <algorithm>
#include <chrono>

#include "actors/gatekeeper.hpp"
#include "actors/head_state.hpp"
#include "actors/log.hpp"
#include "cluster/head_lease.hpp"

namespace troupe::actors::head_detail {

using namespace std::chrono_literals;

namespace {

std::uint64_t now_ms() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

/// The partner is lost: this standby becomes the head.
void take_over(head_ptr self, const std::string& why) {
  auto& st = self->state;
  if (!st.standby_mode) return;
  st.standby_mode = false;
  const auto old_head = st.cfg.node.m.head;
  st.cfg.term = std::max(now_ms(), st.followed_term + 1);
  // From now on this node is the head: placement puts its first stage
  // here, and the nodes take orders from it (its term is higher).
  st.cfg.node.m.head = st.cfg.node.name;
  {
    // This process's own node obeys only this head from now on: the old
    // one, should it come back, is refused here too, and steps down.
    auto& l = cluster::local_head_lease();
    std::lock_guard lk(l.mtx);
    l.lease.offer(to_string(self->node()), st.cfg.term);
  }
  st.cfg.startup_grace = st.cfg.takeover_grace;
  st.started = steady::now();
  st.took_over_at = steady::now();
  if (st.followed) self->demonitor(st.followed.address());
  st.followed = frontdoor_actor{};
  event(self,
        "took over from head " + old_head + " (its term " + std::to_string(st.followed_term) +
            ", this one's " + std::to_string(st.cfg.term) + "): " + why + "; " +
            std::to_string(st.adoptable.size()) + " job(s) wait for their clients",
        true);
  self->send(self, tick_atom::value);
}

/// The manifest's head, probing: its partner is a standby (or does not
/// answer): it serves, as a head that starts does.
void serve_as_head(head_ptr self, const std::string& why) {
  auto& st = self->state;
  if (!st.standby_mode || !st.probing) return;
  st.standby_mode = false;
  st.probing = false;
  st.started = steady::now();
  if (st.followed) self->demonitor(st.followed.address());
  st.followed = frontdoor_actor{};
  event(self, "head: " + why + "; serving as the head (term " + std::to_string(st.cfg.term) + ")");
  self->send(self, tick_atom::value);
}

void resume(head_ptr self, head_state::pending_attach& a) {
  auto& st = self->state;
  auto it = st.adoptable.find(a.id);
  if (it == st.adoptable.end()) {
    a.rp.deliver(make_error(error_code::not_found,
                            "job " + std::to_string(a.id) + " is not waiting here any more"));
    return;
  }
  auto req = std::move(it->second);
  st.adoptable.erase(it);
  req.resumed = std::move(a.tokens);
  const auto r = route(self, req);
  if (r < 0) {
    a.rp.deliver(make_error(error_code::unavailable, "no replica serves"));
    return;
  }
  auto& p = rep(self, r);
  ++p.routed;
  ++st.resumed_jobs;
  journal_begin(self, req);
  const auto id = req.id;
  logging::of("head").info("job {} resumes after {} token(s) on replica {}", id, req.resumed.size(),
                           r);
  self->request(p.scheduler, caf::infinite, submit_atom::value, std::move(req), a.sink)
      .then(
          [self, r, rp = a.rp](submit_ack& ack) mutable {
            answered(self, r);
            rp.deliver(ack);
          },
          [self, r, id, rp = a.rp](caf::error& e) mutable {
            answered(self, r);
            journal_end(self, id);
            rp.deliver(std::move(e));
          });
}

bool any_serving(head_ptr self) {
  const auto& reps = self->state.reps;
  return std::any_of(reps.begin(), reps.end(), [](const replica_rt& p) { return p.serving(); });
}

}  // namespace

void standby_tick(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  const auto lost_after = st.members->options().lost_after;
  if (st.probing && !st.followed_once && now > st.probe_until)
    return serve_as_head(self, "standby " + st.partner + " did not answer");
  if (st.followed_once && now - st.follow_heard > lost_after)
    return take_over(self, "it answered none for " +
                               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  now - st.follow_heard)
                                                  .count()) +
                               " ms");
  if (!st.followed) {
    if (st.follow_joining) return;
    st.follow_joining = true;
    const auto core = caf::actor_cast<head_core_actor>(self);
    // Term 0: it joins as a node (the standby), not as a head.
    self->system().spawn<caf::detached>([core, m = st.cfg.node.m, me = st.cfg.node.name,
                                         partner = st.partner](caf::blocking_actor* b) {
      auto pass = join_node(b->system(), m, me, partner, 2000ms, 0);
      if (pass)
        b->send(core, follow_atom::value, *pass);
      else
        b->send(core, follow_atom::value, pass.error());
    });
    return;
  }
  if (st.follow_asking) return;
  st.follow_asking = true;
  const bool first = !st.followed_once;
  self->request(st.followed, lost_after, follow_atom::value, first)
      .then(
          [self, first, door = st.followed](journal_state& js) {
            auto& st = self->state;
            st.follow_asking = false;
            if (!st.standby_mode || st.followed != door) return;
            st.follow_heard = steady::now();
            st.followed_term = js.term;
            st.follow_why.clear();
            if (first) {
              st.followed_once = true;
              st.probing = false;  // the partner serves: this node is its standby
              st.adoptable.clear();
              for (auto& e : js.jobs)
                if (!e.ended) st.adoptable[e.id] = std::move(e.req);
              event(self, "standby: following head " + st.partner + " (term " +
                              std::to_string(js.term) + ", " + std::to_string(st.adoptable.size()) +
                              " job(s) in its journal)");
            }
          },
          [self](caf::error& e) {
            auto& st = self->state;
            st.follow_asking = false;
            st.follow_why = describe(self->system(), e);
            // The partner is a standby itself: this node is the head.
            if (st.probing && !st.followed_once &&
                troupe_code(e) == static_cast<std::uint8_t>(error_code::not_the_head))
              return serve_as_head(self, "standby " + st.partner + " has not taken over");
            logging::of("head").debug("standby: following {}: {}", st.partner, st.follow_why);
          });
}

bool standby_partner_down(head_ptr self, const caf::actor_addr& source) {
  auto& st = self->state;
  if (!st.followed || st.followed.address() != source) return false;
  st.followed = frontdoor_actor{};
  if (st.standby_mode && st.followed_once) take_over(self, "its connection closed");
  return true;
}

void follow_joined(head_ptr self, gate_pass* pass, const std::string& why) {
  auto& st = self->state;
  st.follow_joining = false;
  if (!st.standby_mode) return;
  if (!pass || !pass->door) {
    st.follow_why =
        pass ? "its gatekeeper handed out no door (is " + st.partner + " the head of this cluster?)"
             : why;
    return;
  }
  st.followed = pass->door;
  self->monitor(st.followed);
  standby_tick(self);  // ask to follow at once
}

void journal_begin(head_ptr self, const generate_request& req) {
  auto& st = self->state;
  if (st.partner.empty()) return;
  st.journal[req.id] = {req, steady::now()};
  if (st.follower)
    self->send(st.follower, journal_atom::value, std::vector<journal_entry>{{req.id, false, req}});
}

void journal_end(head_ptr self, std::uint64_t id) {
  auto& st = self->state;
  if (st.journal.erase(id) && st.follower)
    self->send(st.follower, journal_atom::value,
               std::vector<journal_entry>{{id, true, generate_request{}}});
}

void journal_tick(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  // Attaches waiting for a replica to serve.
  if (!st.attaches.empty()) {
    auto waiting = std::move(st.attaches);
    st.attaches.clear();
    const bool serving = any_serving(self);
    for (auto& a : waiting) {
      if (serving)
        resume(self, a);
      else if (now - a.since > st.cfg.attach_wait)
        a.rp.deliver(
            make_error(error_code::unavailable, "no replica served within " +
                                                    std::to_string(st.cfg.attach_wait.count()) +
                                                    " ms of the takeover"));
      else
        st.attaches.push_back(std::move(a));
    }
  }
  // Jobs whose clients did not come back.
  if (st.took_over_at && !st.adoptable.empty() && now - *st.took_over_at > st.cfg.attach_wait) {
    st.dropped_jobs += static_cast<std::int64_t>(st.adoptable.size());
    event(self,
          std::to_string(st.adoptable.size()) + " job(s) of the old head were dropped: their " +
              "clients did not attach within " + std::to_string(st.cfg.attach_wait.count()) + " ms",
          true);
    st.adoptable.clear();
  }
  // The journal forgets jobs no scheduler holds (ended), once a second.
  if (st.journal.empty() || st.journal_asking || now - st.journal_pruned < 1s) return;
  std::vector<scheduler_actor> schedulers;
  for (const auto& p : st.reps)
    if (p.scheduler) schedulers.push_back(p.scheduler);
  if (schedulers.empty()) return;
  st.journal_asking = true;
  struct gather {
    std::size_t left = 0;
    bool failed = false;
    std::vector<std::uint64_t> live;
  };
  auto g = std::make_shared<gather>();
  g->left = schedulers.size();
  const auto asked = now;
  auto done = [self, g, asked] {
    auto& st = self->state;
    st.journal_asking = false;
    st.journal_pruned = steady::now();
    if (g->failed) return;
    std::sort(g->live.begin(), g->live.end());
    std::vector<journal_entry> ended;
    for (auto it = st.journal.begin(); it != st.journal.end();) {
      // Only entries older than the question: a job accepted since may
      // not have reached its scheduler when it answered.
      if (it->second.at < asked && !std::binary_search(g->live.begin(), g->live.end(), it->first)) {
        ended.push_back({it->first, true, generate_request{}});
        it = st.journal.erase(it);
      } else {
        ++it;
      }
    }
    if (!ended.empty() && st.follower) self->send(st.follower, journal_atom::value, ended);
  };
  for (const auto& s : schedulers)
    self->request(s, 5s, live_atom::value)
        .then(
            [g, done](const std::vector<std::uint64_t>& ids) {
              g->live.insert(g->live.end(), ids.begin(), ids.end());
              if (--g->left == 0) done();
            },
            [g, done](caf::error&) {
              g->failed = true;
              if (--g->left == 0) done();
            });
}

caf::result<journal_state> on_follow(head_ptr self, bool first) {
  auto& st = self->state;
  if (st.standby_mode)
    return make_error(error_code::not_the_head,
                      "node " + st.cfg.node.name + " is a standby head itself");
  if (st.partner.empty())
    return make_error(error_code::invalid_request, "the manifest names no standby head");
  // Only the partner's process may follow (the journal holds every
  // prompt): the one this head joined as that node, over mutual TLS.
  const auto& sender = self->current_sender();
  auto it = st.rt.find(st.partner);
  if (!sender || it == st.rt.end() || !it->second.agent ||
      it->second.agent->node() != sender->node())
    return make_error(error_code::unavailable,
                      "only node " + st.partner + " may follow this head, once it joined it");
  journal_state js;
  js.term = st.cfg.term;
  if (first) {
    if (st.follower) self->demonitor(st.follower.address());
    st.follower = caf::actor_cast<frontdoor_actor>(sender);
    self->monitor(st.follower);
    for (const auto& [id, rec] : st.journal) js.jobs.push_back({id, false, rec.req});
    event(self, "standby " + st.partner + " follows (" + std::to_string(js.jobs.size()) +
                    " job(s) in the journal)");
  } else if (!st.follower || st.follower.node() != sender->node()) {
    return make_error(error_code::invalid_request, "follow first (follow_atom, true)");
  }
  return js;
}

void on_journal(head_ptr self, std::vector<journal_entry>& entries) {
  auto& st = self->state;
  const auto& sender = self->current_sender();
  if (!st.standby_mode || !st.followed || !sender || sender->node() != st.followed.node()) return;
  for (auto& e : entries) {
    if (e.ended)
      st.adoptable.erase(e.id);
    else
      st.adoptable[e.id] = std::move(e.req);
  }
}

caf::result<submit_ack> on_attach(head_ptr self, std::uint64_t id,
                                  std::vector<std::int32_t>& tokens, client_sink_actor& sink) {
  auto& st = self->state;
  if (st.standby_mode)
    return make_error(error_code::unavailable, "node " + st.cfg.node.name +
                                                   " is the standby head: it serves once head " +
                                                   st.partner + " is lost");
  if (!st.adoptable.count(id))
    return make_error(error_code::not_found,
                      "job " + std::to_string(id) + " is not one this head can resume");
  auto rp = self->make_response_promise<submit_ack>();
  head_state::pending_attach a{id, std::move(tokens), std::move(sink), rp, steady::now()};
  if (any_serving(self))
    resume(self, a);
  else
    st.attaches.push_back(std::move(a));
  return rp;
}

}  // namespace troupe::actors::head_detail
