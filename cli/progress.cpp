#include "cli/progress.hpp"

#include <unistd.h>

#include <algorithm>

namespace troupe::cli {

std::string progress_bar(double fraction, int width) {
  if (!(fraction >= 0)) fraction = 0;  // NaN too
  fraction = std::min(fraction, 1.0);
  width = std::max(width, 1);
  const int full = static_cast<int>(fraction * width + 1e-9);
  return "[" + std::string(static_cast<std::size_t>(full), '#') +
         std::string(static_cast<std::size_t>(width - full), '.') + "]";
}

progress::progress(std::FILE* out) : out_(out), tty_(::isatty(::fileno(out)) == 1) {}

void progress::update(const std::string& label, double fraction, const std::string& detail) {
  std::string text = label;
  if (fraction >= 0) {
    char pct[16];
    std::snprintf(pct, sizeof pct, " %3d%%",
                  static_cast<int>(std::min(fraction, 1.0) * 100 + 1e-9));
    text += " " + progress_bar(fraction, 24) + pct;
  }
  if (!detail.empty()) text += "  " + detail;
  if (text == last_) return;
  last_ = text;
  if (tty_) {
    std::fprintf(out_, "\r%s\033[K", text.c_str());
    open_ = true;
  } else {
    std::fprintf(out_, "%s\n", text.c_str());
  }
  std::fflush(out_);
}

void progress::line(const std::string& text) {
  finish();
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void progress::finish() {
  if (open_) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
    open_ = false;
  }
  last_.clear();
}

}  // namespace troupe::cli
