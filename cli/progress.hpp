#pragma once

// Progress for long steps (weight loading, migration): in a terminal one
// line redrawn in place with a bar; otherwise a plain line whenever the
// text changes (logs and pipes stay readable).

#include <cstdio>
#include <string>

namespace troupe::cli {

/// "[#######.............]" for `fraction` (clamped to 0..1) in `width` cells.
std::string progress_bar(double fraction, int width);

class progress {
 public:
  /// `tty`: draw in place (default: whether `out` is a terminal).
  explicit progress(std::FILE* out = stdout);
  progress(std::FILE* out, bool tty) : out_(out), tty_(tty) {}
  ~progress() { finish(); }
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  /// Shows `label`, the bar for `fraction` (negative: no bar) and `detail`.
  void update(const std::string& label, double fraction, const std::string& detail);
  /// Prints a line of its own (ending the bar's line first in a terminal).
  void line(const std::string& text);
  /// Ends the bar's line.
  void finish();
  bool tty() const { return tty_; }

 private:
  std::FILE* out_;
  bool tty_;
  bool open_ = false;  ///< a bar line is drawn and not ended
  std::string last_;
};

}  // namespace troupe::cli
