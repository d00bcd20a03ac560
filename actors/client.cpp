#include "actors/client.hpp"

#include "actors/log.hpp"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace troupe::actors {

struct client::shared {
  std::mutex mtx;
  std::unordered_map<std::uint64_t, callbacks> cbs;
  std::optional<std::string> gone;  ///< the target went away: why
  frontdoor_actor door;             ///< the door now (a failover replaces it)
  // -- with a failover ---------------------------------------------------------
  std::optional<client::failover> fo;
  /// Each open job's tokens received so far (what a new head resumes from).
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> seen;
  /// Events count only from this node (the head now): a head that was
  /// replaced and comes back must not add tokens to a stream.
  caf::node_id source;
  std::int64_t reattached = 0, failovers = 0;
  bool failing_over = false;  ///< new jobs wait for the door of the head that takes over
};

namespace {

/// The sink, and (from this process only) the door to watch after a failover.
using sink_actor = client_sink_actor::extend<caf::reacts_to<attach_atom, frontdoor_actor>>;

/// A finish event for a request whose target went away.
finish_event gone_event(std::uint64_t id, const std::string& why) {
  finish_event f;
  f.id = id;
  f.reason = finish_reason::error;
  f.code = error_code::unavailable;
  f.error = why;
  return f;
}

/// Ends every open job with `why` (the target went away for good).
void end_open(const std::shared_ptr<client::shared>& sh, const std::string& why) {
  std::unordered_map<std::uint64_t, client::callbacks> open;
  {
    std::lock_guard lock(sh->mtx);
    sh->gone = why;
    sh->failing_over = false;
    open.swap(sh->cbs);
    sh->seen.clear();
  }
  for (auto& [id, cb] : open)
    if (cb.on_finish) cb.on_finish(gone_event(id, why));
}

/// After the door went away: a door again (the head, or its standby), and
/// every open job attached to it from the tokens received; on a thread of
/// its own (reconnecting blocks).
void fail_over(caf::actor_system& sys, std::shared_ptr<client::shared> sh, sink_actor sink,
               std::string why) {
  sys.spawn<caf::detached>([sh, sink, why](caf::blocking_actor* b) {
    auto fo = *sh->fo;
    logging::of("client").warn("{}: looking for the head that takes over", why);
    const auto deadline = std::chrono::steady_clock::now() + fo.window;
    std::string last = why;
    std::unordered_set<std::uint64_t> attached;
    while (std::chrono::steady_clock::now() < deadline) {
      auto d = fo.reconnect ? fo.reconnect() : std::unexpected(std::string("no way to reconnect"));
      if (d && *d) {
        std::vector<std::pair<std::uint64_t, std::vector<std::int32_t>>> open;
        {
          std::lock_guard lock(sh->mtx);
          sh->source = d->node();
          for (const auto& [id, cb] : sh->cbs)
            if (!attached.count(id)) open.emplace_back(id, sh->seen[id]);
        }
        bool again = false;
        for (auto& [id, toks] : open) {
          const auto left = std::max<std::chrono::milliseconds>(
              std::chrono::duration_cast<std::chrono::milliseconds>(
                  deadline - std::chrono::steady_clock::now()),
              std::chrono::milliseconds(1));
          b->request(*d, left, attach_atom::value, id, toks,
                     caf::actor_cast<client_sink_actor>(sink))
              .receive(
                  [&, id = id](submit_ack&) {
                    attached.insert(id);
                    std::lock_guard lock(sh->mtx);
                    ++sh->reattached;
                  },
                  [&, id = id](caf::error& e) {
                    const auto code = troupe_code(e);
                    if (code == static_cast<std::uint8_t>(error_code::unavailable) ||
                        e == caf::sec::request_timeout) {
                      again = true;  // a standby not serving yet: ask again
                      last = describe(b->system(), e);
                      return;
                    }
                    client::callbacks cb;
                    {
                      std::lock_guard lock(sh->mtx);
                      auto it = sh->cbs.find(id);
                      if (it == sh->cbs.end()) return;
                      cb = std::move(it->second);
                      sh->cbs.erase(it);
                      sh->seen.erase(id);
                    }
                    auto f = gone_event(id, "the head was lost and the job could not be resumed: " +
                                                describe(b->system(), e));
                    if (code) f.code = static_cast<error_code>(code);
                    if (cb.on_finish) cb.on_finish(f);
                  });
        }
        if (!again) {
          logging::of("client").info("{} job(s) go on at the head that took over", attached.size());
          {
            std::lock_guard lock(sh->mtx);
            sh->door = *d;
            ++sh->failovers;
            sh->failing_over = false;
          }
          b->send(sink, attach_atom::value, *d);
          return;
        }
      } else if (!d) {
        last = d.error();
      }
      std::this_thread::sleep_for(fo.retry_every);
    }
    end_open(sh, why + "; no head took over within " + std::to_string(fo.window.count()) + " ms (" +
                     last + ")");
  });
}

sink_actor::behavior_type sink_impl(sink_actor::stateful_pointer<caf::actor_addr> self,
                                    std::shared_ptr<client::shared> sh, caf::actor_addr target,
                                    std::string what) {
  self->state = target;
  if (target) self->monitor(target);
  self->set_down_handler([=](caf::down_msg& dm) {
    if (dm.source != self->state) return;
    const std::string why = what + " went away (" + self->system().render(dm.reason) + ")";
    if (sh->fo) {
      {
        std::lock_guard lock(sh->mtx);
        sh->failing_over = true;
      }
      return fail_over(self->system(), sh, self, why);
    }
    end_open(sh, why);
  });
  // With a failover, only the head now speaks for a job.
  auto heard = [=](std::uint64_t) {
    if (!sh->fo) return true;
    const auto& s = self->current_sender();
    return s && s->node() == sh->source;
  };
  return {
      [=](const token_event& e) {
        std::function<void(const token_event&)> f;
        {
          std::lock_guard lock(sh->mtx);
          if (!heard(e.id)) return;
          auto it = sh->cbs.find(e.id);
          if (it != sh->cbs.end()) {
            f = it->second.on_token;
            if (sh->fo) {
              auto& v = sh->seen[e.id];
              v.insert(v.end(), e.tokens.begin(), e.tokens.end());
            }
          }
        }
        if (f) f(e);
      },
      [=](const finish_event& e) {
        std::function<void(const finish_event&)> f;
        {
          std::lock_guard lock(sh->mtx);
          if (!heard(e.id)) return;
          auto it = sh->cbs.find(e.id);
          if (it != sh->cbs.end()) {
            f = std::move(it->second.on_finish);
            sh->cbs.erase(it);
            sh->seen.erase(e.id);
          }
        }
        if (f) f(e);
      },
      [=](attach_atom, frontdoor_actor& d) {
        // From this process's failover only.
        const auto& s = self->current_sender();
        if (!s || s->node() != self->node()) return;
        self->state = d.address();
        self->monitor(d);
      },
  };
}

}  // namespace

client::client(caf::actor_system& sys, scheduler_actor scheduler)
    : sys_(sys), target_(scheduler), shared_(std::make_shared<shared>()) {
  if (!scheduler) shared_->gone = "no scheduler to submit to";
  sink_ = caf::actor_cast<client_sink_actor>(
      sys_.spawn(sink_impl, shared_, scheduler.address(), std::string("the scheduler")));
}

client::client(caf::actor_system& sys, frontdoor_actor door)
    : sys_(sys), target_(door), shared_(std::make_shared<shared>()) {
  if (!door) shared_->gone = "no door of a cluster to submit to";
  shared_->door = door;
  sink_ = caf::actor_cast<client_sink_actor>(
      sys_.spawn(sink_impl, shared_, door.address(), std::string("the head")));
}

client::client(caf::actor_system& sys, frontdoor_actor door, failover fo)
    : sys_(sys), target_(door), shared_(std::make_shared<shared>()) {
  if (!door) shared_->gone = "no door of a cluster to submit to";
  shared_->door = door;
  if (door) shared_->source = door.node();
  shared_->fo = std::move(fo);
  sink_ = caf::actor_cast<client_sink_actor>(
      sys_.spawn(sink_impl, shared_, door.address(), std::string("the head")));
}

std::variant<scheduler_actor, frontdoor_actor> client::target() const {
  if (std::holds_alternative<scheduler_actor>(target_)) return target_;
  std::lock_guard lock(shared_->mtx);
  return shared_->door;
}

frontdoor_actor client::door() const {
  std::lock_guard lock(shared_->mtx);
  return shared_->door;
}

std::int64_t client::reattached() const {
  std::lock_guard lock(shared_->mtx);
  return shared_->reattached;
}

std::int64_t client::failovers() const {
  std::lock_guard lock(shared_->mtx);
  return shared_->failovers;
}

client::~client() {
  caf::anon_send_exit(sink_, caf::exit_reason::user_shutdown);
}

std::uint64_t client::next_id() {
  static std::atomic<std::uint64_t> next{1};
  return next++;
}

std::uint64_t random_job_id() {
  static std::mutex mtx;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard lock(mtx);
  std::uint64_t id = 0;
  while (id == 0) id = gen();
  return id;
}

template <class Request>
std::expected<submit_ack, client::rejection> client::submit_to(Request req, callbacks cb) {
  const auto id = req.id;
  {
    std::lock_guard lock(shared_->mtx);
    if (shared_->gone) return std::unexpected(rejection{error_code::unavailable, *shared_->gone});
    if (shared_->failing_over)
      return std::unexpected(rejection{error_code::unavailable,
                                       "the head was lost; its standby is taking over: retry"});
    shared_->cbs[id] = std::move(cb);
  }
  std::expected<submit_ack, rejection> out =
      std::unexpected(rejection{error_code::internal, "no answer"});
  caf::scoped_actor self{sys_};
  auto on_ack = [&](submit_ack& a) { out = a; };
  auto on_error = [&](caf::error& e) {
    const auto code = troupe_code(e);
    out = std::unexpected(
        rejection{code ? static_cast<error_code>(code) : error_code::internal, describe(sys_, e)});
  };
  if constexpr (std::is_same_v<Request, generate_request>)
    self->request(std::get<scheduler_actor>(target_), caf::infinite, submit_atom::value,
                  std::move(req), sink_)
        .receive(on_ack, on_error);
  else
    self->request(std::get<frontdoor_actor>(target()), caf::infinite, submit_atom::value,
                  std::move(req), sink_)
        .receive(on_ack, on_error);
  if (!out) {
    std::lock_guard lock(shared_->mtx);
    shared_->cbs.erase(id);
  }
  return out;
}

std::expected<submit_ack, client::rejection> client::submit(generate_request req, callbacks cb) {
  if (!std::holds_alternative<scheduler_actor>(target_))
    return std::unexpected(
        rejection{error_code::invalid_request, "a cluster's door takes jobs, not requests"});
  return submit_to(std::move(req), std::move(cb));
}

std::expected<submit_ack, client::rejection> client::submit(job_request job, callbacks cb) {
  if (!std::holds_alternative<frontdoor_actor>(target_))
    return std::unexpected(
        rejection{error_code::invalid_request, "a scheduler takes requests, not jobs"});
  return submit_to(std::move(job), std::move(cb));
}

template <class Request>
std::expected<finish_event, client::rejection> client::run_to(
    Request req, std::function<void(const token_event&)> on_token) {
  struct waiter {
    std::mutex m;
    std::condition_variable cv;
    std::optional<finish_event> done;
  };
  auto w = std::make_shared<waiter>();
  callbacks cb;
  cb.on_token = std::move(on_token);
  cb.on_finish = [w](const finish_event& f) {
    std::lock_guard lock(w->m);
    w->done = f;
    w->cv.notify_all();
  };
  auto ack = submit(std::move(req), std::move(cb));
  if (!ack) return std::unexpected(ack.error());
  std::unique_lock lock(w->m);
  w->cv.wait(lock, [&] { return w->done.has_value(); });
  return *w->done;
}

std::expected<finish_event, client::rejection> client::run(
    generate_request req, std::function<void(const token_event&)> on_token) {
  return run_to(std::move(req), std::move(on_token));
}

std::expected<finish_event, client::rejection> client::run(
    job_request job, std::function<void(const token_event&)> on_token) {
  return run_to(std::move(job), std::move(on_token));
}

std::expected<stream_progress, client::rejection> client::send_audio(
    std::uint64_t id, std::vector<std::uint8_t> pcm, bool last, std::chrono::milliseconds timeout) {
  {
    std::lock_guard lock(shared_->mtx);
    if (shared_->gone) return std::unexpected(rejection{error_code::unavailable, "no target"});
  }
  caf::scoped_actor self{sys_};
  std::expected<stream_progress, rejection> out =
      std::unexpected(rejection{error_code::internal, "no answer"});
  audio_chunk ch{id, -1, std::move(pcm), last};
  std::visit(
      [&](const auto& target) {
        self->request(target, timeout, chunk_atom::value, std::move(ch))
            .receive([&](stream_progress& p) { out = p; },
                     [&](caf::error& e) {
                       const auto code = troupe_code(e);
                       out = std::unexpected(
                           rejection{code ? static_cast<error_code>(code) : error_code::unavailable,
                                     describe(sys_, e)});
                     });
      },
      target());
  return out;
}

void client::send_audio_async(std::uint64_t id, std::vector<std::uint8_t> pcm, bool last,
                              audio_sent done, std::chrono::milliseconds timeout) {
  bool gone = false;
  {
    std::lock_guard lock(shared_->mtx);
    gone = shared_->gone.has_value();
  }
  std::visit(
      [&](const auto& target) {
        sys_.spawn(
            [target, gone, done = std::move(done), timeout,
             ch = audio_chunk{id, -1, std::move(pcm), last}](caf::event_based_actor* self) mutable {
              if (gone)
                return done(std::unexpected(rejection{error_code::unavailable, "no target"}));
              self->request(target, timeout, chunk_atom::value, std::move(ch))
                  .then([done](stream_progress& p) { done(p); },
                        [self, done](caf::error& e) {
                          const auto code = troupe_code(e);
                          done(std::unexpected(rejection{
                              code ? static_cast<error_code>(code) : error_code::unavailable,
                              describe(self->system(), e)}));
                        });
            });
      },
      target());
}

bool client::cancel(std::uint64_t id) {
  {
    std::lock_guard lock(shared_->mtx);
    if (shared_->gone) return false;
  }
  caf::scoped_actor self{sys_};
  bool found = false;
  auto on_answer = [&](bool b) { found = b; };
  auto on_error = [](caf::error&) {};
  std::visit(
      [&](const auto& target) {
        self->request(target, std::chrono::seconds(10), cancel_atom::value, id)
            .receive(on_answer, on_error);
      },
      target());
  return found;
}

void client::submit_async(job_request job, callbacks cb, submitted done,
                          std::chrono::milliseconds timeout) {
  const auto id = job.id;
  const auto now = target();
  auto* door = std::get_if<frontdoor_actor>(&now);
  if (!door) {
    done(std::unexpected(
        rejection{error_code::invalid_request, "a scheduler takes requests, not jobs"}));
    return;
  }
  {
    std::lock_guard lock(shared_->mtx);
    if (shared_->gone || shared_->failing_over) {
      const auto why =
          shared_->gone.value_or("the head was lost; its standby is taking over: retry");
      // Not in this call (the caller may hold its own lock): on an actor.
      sys_.spawn([done, why](caf::event_based_actor*) {
        done(std::unexpected(rejection{error_code::unavailable, why}));
      });
      return;
    }
    shared_->cbs[id] = std::move(cb);
  }
  sys_.spawn([job = std::move(job), done = std::move(done), sh = shared_, target = *door,
              sink = sink_, timeout](caf::event_based_actor* self) mutable {
    const auto id = job.id;
    auto fail = [sh, id, done](rejection r) {
      {
        std::lock_guard lock(sh->mtx);
        sh->cbs.erase(id);
      }
      done(std::unexpected(std::move(r)));
    };
    self->request(target, timeout, submit_atom::value, std::move(job), sink)
        .then([done](submit_ack& a) { done(a); },
              [self, fail, target, id, timeout](caf::error& e) {
                if (e == caf::sec::request_timeout) {
                  // The job may still start: cancel it, unheard.
                  self->send(target, cancel_atom::value, id);
                  fail(rejection{
                      error_code::unavailable,
                      "the head did not answer within " + std::to_string(timeout.count()) + " ms"});
                  return;
                }
                const auto code = troupe_code(e);
                fail(rejection{code ? static_cast<error_code>(code) : error_code::unavailable,
                               describe(self->system(), e)});
              });
  });
}

void client::cancel_async(std::uint64_t id) {
  const auto now = target();
  if (auto* door = std::get_if<frontdoor_actor>(&now)) {
    caf::anon_send(*door, cancel_atom::value, id);
  } else if (auto* sched = std::get_if<scheduler_actor>(&now)) {
    caf::anon_send(*sched, cancel_atom::value, id);
  }
}

std::string client::gone() const {
  std::lock_guard lock(shared_->mtx);
  return shared_->gone.value_or("");
}

scheduler_stats client::stats() {
  scheduler_stats s;
  if (auto* sched = std::get_if<scheduler_actor>(&target_)) {
    caf::scoped_actor self{sys_};
    self->request(*sched, std::chrono::seconds(10), stats_atom::value)
        .receive([&](scheduler_stats& x) { s = x; }, [](caf::error&) {});
  }
  return s;
}

}  // namespace troupe::actors
