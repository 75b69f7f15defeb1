#include "core/checkpoint/preemption.h"

#include <signal.h>

#include <cstring>

namespace moetrain {
namespace {

volatile sig_atomic_t g_signal = 0;

extern "C" void record_preemption_signal(int signal_number) {
  if (signal_number == SIGINT && g_signal != 0) {
    // Ctrl-C again: the user wants out now.
    ::signal(SIGINT, SIG_DFL);
    ::raise(SIGINT);
    return;
  }
  g_signal = signal_number;
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = record_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a signal must not make a read() or write() fail with EINTR
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGUSR1, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);
}

bool preemption_requested() { return g_signal != 0; }
int preemption_signal() { return g_signal; }

const char* preemption_signal_name() {
  switch (g_signal) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case 0: return "none";
    default: return "a signal";
  }
}

void clear_preemption_request() { g_signal = 0; }

}  // namespace moetrain
